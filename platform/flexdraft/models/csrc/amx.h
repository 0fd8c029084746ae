// AMX tile set-up for the kernels in this folder that use AMX-BF16 (built only for CPUs with AVX512-BF16: kernels.py
// adds -mamx-tile -mamx-bf16 there). Every kernel here configures all eight tiles alike: 16 rows of 64 bytes.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace flexdraft_kernels {

struct TileConfig {  // ldtilecfg's 64-byte layout, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// whether this process may use AMX: Linux hands out the tile data only on request (ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), and refuses on a CPU without it
inline bool amx_ready() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// amx_ready, unless FLEXDRAFT_CPU_AMX=0 (read once): for kernels that pick AMX themselves, as decode_attention does
inline bool amx_wanted() {
  static const bool wanted = [] {
    const char* env = std::getenv("FLEXDRAFT_CPU_AMX");
    return !(env && std::strcmp(env, "0") == 0) && amx_ready();
  }();
  return wanted;
}

// eight tiles of 16 rows x 64 bytes (16 fp32, or 32 bf16 as 16 pairs) on this thread; _tile_release() after use
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace flexdraft_kernels
