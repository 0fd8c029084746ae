"""The FlexDraft drafter: tuned attention projectors in the target's deepest layers, drafting a block of
mask tokens over the target's own KV cache (docs/design.md).

Shapes: R = rows (sequences), N = block slots per row (all blocks of a row, concatenated), S = cached
prefix slots visible, d = model width, L = target layers, s = L - k = first tuned layer, e = entry layer.

A block anchored after position p has B + 1 slots at positions p+1 .. p+B+1: slot 0 holds the bonus token's
embedding (when known) or the mask embedding, slots 1..B the mask embedding; slot j >= 1 drafts the token
at position p+1+j. Slots enter at layer e. In layers e..s-1 they run through the target's own, frozen layer
and attend causally within their block; in layers s..L-1 they use the drafter's projectors Q'K'V'O' and
attend to their whole block (bidirectional). In every layer they also attend to the target's cached keys
and values of the prefix (slots <= p), which they never modify: the target's own path is untouched.

A known bonus in slot 0 is a clean token: it takes the target's own path in every layer (its projectors,
attending to the prefix and itself only), so its output is exactly the target's next-token distribution at
p+1 and it is the block's first draft; the mask slots see it as they see the prefix. Slot 1 drafts the same
position and goes unused then (`draft_slots`). A masked slot 0 (the bonus not known yet) is a block slot.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from flexdraft.core.errors import FlexDraftError
from flexdraft.models.config import ModelArgs
from flexdraft.models.linear import Linear
from flexdraft.models.transformer import Attention, KVCache, Transformer, TunedLayers

FORMAT = "flexdraft-drafter/3"  # 2: the calibration MLP normalises its inputs; 3: a known bonus takes the target's path
WEIGHTS, META = "drafter.safetensors", "drafter.json"


@dataclass
class DrafterConfig:
    k: int = 24  # tuned (deepest) layers
    block_size: int = 8  # B: draft tokens per block (the block has B + 1 slots)
    entry_layer: int = 0  # e: where block slots enter the network, 0 <= e <= L - k
    tuned_attention: str = "bidirectional"  # in-block attention in the tuned layers: bidirectional | causal
    calibration_hidden: int = 0  # width of the calibration MLP's hidden layer; 0 = model width

    def check(self, args: ModelArgs) -> None:
        L = args.n_layers
        if not 1 <= self.k <= L:
            raise FlexDraftError(f"drafter k={self.k} must be between 1 and the model's {L} layers")
        if self.block_size < 1:
            raise FlexDraftError(f"drafter block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.entry_layer <= L - self.k:
            raise FlexDraftError(f"drafter entry_layer={self.entry_layer} must be between 0 and "
                                 f"L - k = {L - self.k} (L={L}, k={self.k})")
        if self.tuned_attention not in ("bidirectional", "causal"):
            raise FlexDraftError(f"drafter tuned_attention must be bidirectional or causal, got {self.tuned_attention!r}")
        if self.calibration_hidden < 0:
            raise FlexDraftError(f"drafter calibration_hidden must be >= 0, got {self.calibration_hidden}")


class CalibrationMLP(nn.Module):
    """[embed(bonus); h_j] -> a correction c_j in hidden space (section 4). The last layer starts at zero, so
    a fresh calibration leaves the drafts unchanged."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(2 * dim, hidden)
        self.down = nn.Linear(hidden, dim)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    @torch.no_grad()
    def reset(self, seed: int = 0) -> None:
        """The first layer's init as nn.Linear's own, but from a seeded generator: unseeded, two runs of one
        config started calibration (and saved attention-stage drafters) from different weights."""
        g = torch.Generator().manual_seed(seed)
        w = nn.init.kaiming_uniform_(torch.empty(self.up.weight.shape), a=math.sqrt(5), generator=g)
        bound = 1 / math.sqrt(w.shape[1])
        self.up.weight.copy_(w)
        self.up.bias.copy_(torch.empty(self.up.bias.shape).uniform_(-bound, bound, generator=g))

    def forward(self, bonus_embedding: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # both halves RMS-normalised: SmolLM2's embeddings have RMS ~0.13 against ~1.8 for the final-normed
        # hidden state, and unnormalised the bonus barely moved the first layer (calibration gained nothing)
        d = h.shape[-1]  # the bonus embedding has the same width
        x = torch.cat((F.rms_norm(bonus_embedding, (d,)), F.rms_norm(h, (d,))), dim=-1)
        return self.down(F.silu(self.up(x)))


class PairedAttention:
    """Inference only: a tuned layer's target and drafter projectors read in one GEMM for q/k/v and one for o,
    over every block slot; a clean slot keeps the target's half, the others the drafter's. At batch 1 the
    drafter pass is dominated by per-call costs: 2 GEMMs per tuned layer instead of 8, and each slot's half of
    q/k/v is picked before the head reshapes and rope (one rope, not two); the outputs are the same.
    The concatenated weights are copies: pair again after changing the drafter's."""

    def __init__(self, target_attn: Attention, drafter_attn: Attention):
        self.target_attn, self.drafter_attn = target_attn, drafter_attn
        qkv = [m for a in (target_attn, drafter_attn) for m in (a.q_proj, a.k_proj, a.v_proj)]
        self.qkv_sizes = [m.out_features for m in qkv]
        o = target_attn.o_proj  # a prepacked target's (its o is never fused: see Fused)
        pack = o.one_row if o.packed is not None else None
        self.qkv = Linear.concat(qkv, pack)
        self.o = Linear.concat([target_attn.o_proj, drafter_attn.o_proj], pack)

    def project(self, x, cos, sin, clean: torch.Tensor):
        """x [R, N, d], clean [R, N] -> q, k, v as `Attention.project` gives them, the target's at clean slots."""
        both = self.qkv(x)  # [R, N, 2 * (H + 2 Hkv) * D]
        if self.target_attn.q_norm is None:  # pick each slot's half first: one rope, not two (no per-set norms)
            own, tuned = both.chunk(2, dim=-1)
            return self.target_attn.fused_heads(torch.where(clean[..., None], own, tuned), cos, sin)
        parts = both.split(self.qkv_sizes, dim=-1)
        own = self.target_attn.heads(*parts[:3], cos, sin)
        tuned = self.drafter_attn.heads(*parts[3:], cos, sin)
        c = clean[:, None, :, None]
        return tuple(torch.where(c, a, b) for a, b in zip(own, tuned))

    def output(self, y, clean: torch.Tensor):
        """y [R, H, N, D] -> [R, N, d] through the target's o at clean slots, the drafter's elsewhere."""
        R, H, N, D = y.shape
        own, tuned = self.o(y.transpose(1, 2).reshape(R, N, H * D)).chunk(2, dim=-1)
        return torch.where(clean[..., None], own, tuned)

    def at(self, clean: torch.Tensor) -> CleanSlots:
        """These projections for one pass whose clean slots are `clean` [R, N] (what `DecoderLayer` takes)."""
        return CleanSlots(lambda x, cos, sin: self.project(x, cos, sin, clean), lambda y: self.output(y, clean))


class CleanSlots:
    """A tuned layer's projections for one pass in which some slots are clean (they take the target's path):
    `project` and `output` as `Attention` has them, for `DecoderLayer`."""

    def __init__(self, project, output):
        self.project, self.output = project, output

    @staticmethod
    def unpaired(target_attn: Attention, drafter_attn: Attention, clean: tuple) -> CleanSlots:
        """Training's path (no paired copies): the drafter's projections for every slot, then the clean slots'
        (clean = (mask [R, N], rows, slots)) recomputed with the target's and written over them."""
        _, r, n = clean

        def project(x, cos, sin):
            q, k, v = drafter_attn.project(x, cos, sin)
            qc, kc, vc = target_attn.project(x[r, n][None], cos[r, 0, n][None, None], sin[r, 0, n][None, None])
            q, k, v = q.clone(), k.clone(), v.clone()  # [R, H, N, D]; the clean ones [1, H, M, D] at (r, :, n)
            q[r, :, n], k[r, :, n], v[r, :, n] = qc[0].transpose(0, 1), kc[0].transpose(0, 1), vc[0].transpose(0, 1)
            return q, k, v

        def output(y):
            out = drafter_attn.output(y).clone()
            out[r, n] = target_attn.output(y[r, :, n].transpose(0, 1)[None])[0]
            return out

        return CleanSlots(project, output)


class Drafter(nn.Module):
    """Trainable tensors only: `attn[i]` are the projectors of target layer s + i, `mask_embedding` [d],
    `calibration`. The target is passed to every call and never owned (it stays frozen and shared)."""

    def __init__(self, args: ModelArgs, config: DrafterConfig):
        super().__init__()
        config.check(args)
        self.args, self.config = args, config
        self.first_tuned = args.n_layers - config.k  # s
        self.attn = nn.ModuleList(Attention(args) for _ in range(config.k))
        # trained only when blocks enter at the first tuned layer; otherwise frozen (the shallow block pass then
        # needs no gradients) at the mean input embedding (set by from_target)
        self.mask_embedding = nn.Parameter(torch.zeros(args.dim), requires_grad=config.entry_layer == self.first_tuned)
        self.calibration = CalibrationMLP(args.dim, config.calibration_hidden or args.dim)
        self.paired: list[PairedAttention] | None = None  # inference: see pair_with (a plain list: not saved)
        self.stack_params: list[torch.Tensor | None] = []  # the paired GEMMs' tensors for the C++ layer stack

    @classmethod
    def from_target(cls, target: Transformer, config: DrafterConfig) -> Drafter:
        """A fresh drafter: projectors copied from the target's, mask embedding = mean input embedding, the
        calibration MLP seeded (a function of the target and config alone)."""
        drafter = cls(target.args, config).to(device=target.device, dtype=target.dtype)
        with torch.no_grad():
            for i, attn in enumerate(drafter.attn):
                src = target.layers[drafter.first_tuned + i].self_attn.state_dict()
                attn.load_state_dict({k: v.clone() for k, v in src.items()})
            drafter.mask_embedding.copy_(target.embed_tokens.weight.float().mean(0))
        drafter.calibration.reset()
        return drafter

    def parameters_for(self, stage: str) -> list[nn.Parameter]:
        """The tensors a training stage updates ("attention" or "calibration"); sets requires_grad to match."""
        if stage not in ("attention", "calibration"):
            raise FlexDraftError(f"unknown training stage {stage!r}: attention or calibration")
        train_mask = stage == "attention" and self.config.entry_layer == self.first_tuned
        for name, p in self.named_parameters():
            if name == "mask_embedding":
                p.requires_grad_(train_mask)
            else:
                p.requires_grad_(name.startswith("attn.") == (stage == "attention"))
        return [p for p in self.parameters() if p.requires_grad]

    def pair_with(self, target: Transformer) -> None:
        """Inference only: read each tuned layer's target and drafter projectors in one GEMM
        (`PairedAttention`). Training keeps the unpaired path, which runs the target's projectors on the clean
        slots alone."""
        self.paired = [PairedAttention(target.layers[self.first_tuned + i].self_attn, attn)
                       for i, attn in enumerate(self.attn)]
        self.stack_params = [t for p in self.paired for m in (p.qkv, p.o) for t in (m.weight, m.packed, m.tiles, m.bias)]

    def tuned_layers(self, clean: torch.Tensor, mask: torch.Tensor) -> TunedLayers:
        """The tuned layers of a paired pass (`pair_with`) whose clean slots are `clean` [R, N], attending under
        `mask`: what `Transformer.run_layers` takes."""
        return TunedLayers(self.first_tuned, self.paired, clean, mask, self.stack_params)

    def to_runtime(self, target: Transformer) -> Drafter:
        """Ready for inference beside a target made ready by `Transformer.to_runtime`: its linear layers
        prepacked where the target's are, its projectors paired with the target's. Again after any change to
        its weights (the packed and paired copies do not follow)."""
        head = target.lm_head
        for module in self.modules():
            if isinstance(module, Linear):
                module.unpack()
                if head.packed is not None:
                    module.pack(head.one_row)
        self.pair_with(target)
        return self

    @staticmethod
    def clean_slots(causal: torch.Tensor, tuned: torch.Tensor, clean: torch.Tensor | None):
        """Tuned-layer in-block mask [R, N, S'] in which clean slots (clean [R, N]) attend causally, as the
        target's token would, and (clean, rows, slots): the mask and its indices for `block_layer` (None when
        there are none)."""
        if clean is None or not bool(clean.any()):
            return tuned, None
        return torch.where(clean[:, :, None], causal, tuned), (clean, *clean.nonzero(as_tuple=True))

    def block_masks(self, target: Transformer, pos: torch.Tensor, block_of: torch.Tensor,
                    ctx_mask: torch.Tensor, clean: torch.Tensor | None) -> tuple[list[torch.Tensor], tuple | None]:
        """Attention masks of block slots for the shallow (causal in-block) and the tuned layers, over
        [ctx slots ; block slots]: bool [R, 1, N, S + N], or additive biases on the bf16-on-CPU path; and the
        clean slots (`clean_slots`)."""
        same = block_of[:, :, None] == block_of[:, None, :]  # [R, N, N]
        causal = same & (pos[:, None, :] <= pos[:, :, None])
        tuned, clean_at = self.clean_slots(causal, same if self.config.tuned_attention == "bidirectional" else causal,
                                            clean)
        return [target.attention_mask(torch.cat((ctx_mask, m), dim=-1)[:, None]) for m in (causal, tuned)], clean_at

    def block_layer(self, target: Transformer, layer_idx: int, x: torch.Tensor, cos, sin, kv,
                    masks: list[torch.Tensor], clean: tuple | None) -> torch.Tensor:
        """One layer for block slots x [R, N, d] -> [R, N, d]: the target's `DecoderLayer` with the drafter's
        projections in a tuned layer. kv as `DecoderLayer` takes it; clean: (mask [R, N], rows, slots) of the
        clean slots, which keep the target's projections in the tuned layers too."""
        layer = target.layers[layer_idx]
        i = layer_idx - self.first_tuned
        if i < 0:
            attn = layer.self_attn
        elif clean is None:
            attn = self.attn[i]
        elif self.paired:
            attn = self.paired[i].at(clean[0])
        else:
            attn = CleanSlots.unpaired(layer.self_attn, self.attn[i], clean)
        return layer(x, cos, sin, masks[i >= 0], kv, attn)

    def forward(self, target: Transformer, inputs: torch.Tensor, pos: torch.Tensor, block_of: torch.Tensor,
                cache: KVCache, ctx_mask: torch.Tensor, rows: torch.Tensor | None = None,
                clean: torch.Tensor | None = None) -> torch.Tensor:
        """Draft blocks -> final-normed hidden states [R, N, d] (logits: `target.logits`).

        inputs [R, N, d]: slot input embeddings; pos [R, N]: slot positions; block_of [R, N]: the block each
        slot belongs to (a block never sees another); cache: the target's cache, read only; ctx_mask
        [R, N, S]: the cached slots each block slot may see (its prefix); rows [R]: the cache rows these
        blocks read (default: cache row r for block row r); clean [R, N]: slots holding a known bonus (see the
        module docstring)."""
        masks, clean_at = self.block_masks(target, pos, block_of, ctx_mask, clean)
        S = ctx_mask.shape[-1]
        x = inputs
        cos, sin = target.rope(pos, x.dtype)
        for i in range(self.config.entry_layer, self.args.n_layers):
            ctx_k, ctx_v = cache.k[i][:, :, :S], cache.v[i][:, :, :S]
            if rows is not None:
                ctx_k, ctx_v = ctx_k[rows], ctx_v[rows]
            def after_prefix(k, v, ctx_k=ctx_k, ctx_v=ctx_v):  # -> [R, Hkv, S + N, D]
                return torch.cat((ctx_k, k), dim=2), torch.cat((ctx_v, v), dim=2)

            x = self.block_layer(target, i, x, cos, sin, after_prefix, masks, clean_at)
        return target.norm(x)

    def forward_in_cache(self, target: Transformer, inputs: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One block per cache row, at the row's length, slot 0 the known bonus (a clean token): inputs [R, T, d]
        -> final-normed hidden [R, T, d].

        The same computation as `forward` for such blocks, without copying the prefix's keys/values: each
        layer writes the block's keys/values into the cache at slots lens .. lens+T-1, past the row's length
        (scratch that the next write there replaces; the row's length is unchanged), and attends over the
        cache: causally in the shallow layers (slot <= own position), to the prefix and the whole block in
        the tuned ones (slot < lens + T, or causal when so configured; causal for slot 0)."""
        R, T, _ = inputs.shape
        pos = cache.next_positions(T)  # [R, T]
        span = int(pos.max()) + 1
        slots = torch.arange(span, device=inputs.device)
        causal = slots <= pos[..., None]  # [R, T, span]
        whole = (slots < (cache.lens + T)[:, None, None]).expand(R, T, span)
        bonus = (torch.arange(T, device=inputs.device) == 0).expand(R, T)  # slot 0: a clean token
        tuned, clean_at = self.clean_slots(causal, whole if self.config.tuned_attention == "bidirectional" else causal,
                                            bonus)
        masks = [target.attention_mask(m[:, None]) for m in (causal, tuned)]
        x = inputs
        cos, sin = target.rope(pos, x.dtype)
        e = self.config.entry_layer
        if self.paired:  # inference: as one C++ call where it can (`Transformer.run_layers`)
            return target.norm(target.run_layers(x, cos, sin, masks[0], pos, span, cache, start=e,
                                                 tuned=self.tuned_layers(bonus, masks[1])))
        for i in range(e, self.args.n_layers):
            x = self.block_layer(target, i, x, cos, sin, cache.writer(i, pos, span), masks, clean_at)
        return target.norm(x)

    def slot_inputs(self, target: Transformer, bonus: torch.Tensor, bonus_known: torch.Tensor) -> torch.Tensor:
        """bonus, bonus_known [...] -> [..., B + 1, d]: slot 0 = embed(bonus) where known, else the mask."""
        shape = (*bonus.shape, self.config.block_size + 1, self.args.dim)
        x = self.mask_embedding.to(target.dtype).expand(shape).clone()
        x[..., 0, :] = torch.where(bonus_known[..., None], target.embed_tokens(bonus), x[..., 0, :])
        return x

    @staticmethod
    def draft_slots(block: int, bonus_known: bool) -> list[int]:
        """The slots whose outputs are drafts d_1..d_block of a block of block + 1 slots: with a known bonus,
        slot 0 (the target's own next token) and slots 2..block; with a masked slot 0, slots 1..block."""
        return [0, *range(2, block + 1)] if bonus_known else list(range(1, block + 1))

    def calibrate(self, target: Transformer, h: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """h [..., d] draft hidden states, bonus [...] the bonus token of each -> corrected hidden states
        (logits_j + LMHead(c_j) = LMHead(h_j + c_j): the LM head is linear)."""
        return h + self.calibration(target.embed_tokens(bonus), h)


def save_drafter(drafter: Drafter, folder: str | Path, base_name: str, base_fingerprint: str,
                 info: dict | None = None) -> Path:
    """Safetensors of the drafter's own tensors (fp32) + drafter.json; written to a temp name, then renamed."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, folder / (WEIGHTS + ".tmp"))
    meta = {"format": FORMAT, "config": asdict(drafter.config), "base_model": base_name,
            "base_fingerprint": base_fingerprint, "n_layers": drafter.args.n_layers, "dim": drafter.args.dim,
            **(info or {})}
    (folder / (META + ".tmp")).write_text(json.dumps(meta, indent=2))
    (folder / (WEIGHTS + ".tmp")).rename(folder / WEIGHTS)
    (folder / (META + ".tmp")).rename(folder / META)
    return folder


def read_drafter_meta(folder: str | Path) -> dict:
    folder = Path(folder)
    if not (folder / META).is_file() or not (folder / WEIGHTS).is_file():
        raise FlexDraftError(f"no drafter in {folder}: expected {META} and {WEIGHTS}")
    try:
        meta = json.loads((folder / META).read_text())
    except json.JSONDecodeError as e:
        raise FlexDraftError(f"{folder / META} is not valid JSON: {e}") from None
    if meta.get("format") in ("flexdraft-drafter/1", "flexdraft-drafter/2"):
        raise FlexDraftError(f"{folder}: trained by an older FlexDraft ({meta['format']}: a known bonus took the tuned "
                             "projectors); train it again (flexdraft pipeline --config ...)")
    if meta.get("format") != FORMAT:
        raise FlexDraftError(f"{folder / META}: unknown drafter format {meta.get('format')!r} (expected {FORMAT})")
    return meta


def load_drafter(folder: str | Path, target: Transformer) -> Drafter:
    """Load a saved drafter for `target`; refuses one made for other base weights."""
    from safetensors.torch import load_file

    from flexdraft.core.config import from_dict

    meta = read_drafter_meta(folder)
    fingerprint = target.fingerprint
    if meta["base_fingerprint"] != fingerprint:
        raise FlexDraftError(f"drafter {folder} was trained for other base weights ({meta['base_model']}, "
                             f"fingerprint {meta['base_fingerprint']}); the loaded model's is {fingerprint}")
    drafter = Drafter(target.args, from_dict(DrafterConfig, meta["config"], ".drafter"))
    state = load_file(Path(folder) / WEIGHTS)
    want = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    if want != have:
        bad = sorted(set(want) ^ set(have)) or sorted(k for k in want if want[k] != have[k])
        raise FlexDraftError(f"drafter {folder}: its weights do not match its config {meta['config']} "
                             f"(k={drafter.config.k} tuned layers expected; first mismatch: {bad[0]})")
    drafter.load_state_dict(state)
    return drafter.to(device=target.device, dtype=target.dtype)


def parallel_forward(target: Transformer, drafter: Drafter, tokens: torch.Tensor, pos: torch.Tensor, cache,
                     anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over verify tokens [n, T] that also carries, from the drafter's entry layer on, a
    masked draft block per branch: branch anchors [n, m] (a = accepted drafts it assumes) -> clean hidden
    states [n, T, d] and branch hidden states [n, m, T, d].

    Branch a sits at positions pos[:, a] + 1 .. + T and sees the cached prefix plus verify tokens 0..a
    (written into the cache by this layer's clean path before the branches read it) and its own block;
    slot 0 is the mask (the bonus is not known yet). Clean and branch tokens share every GEMM whose weights
    they share (norms, the target's projectors below the tuned layers, FFNs): at batch 1 the forward is
    memory-bound and reading the weights once is what makes the branches nearly free (in the tuned layers the
    paired projectors, `Drafter.pair_with`, read both sets at once). The clean tokens never
    attend to a branch token, so their outputs equal a plain verify's up to the rounding of the larger GEMMs
    (fp32: ~1e-6 relative; tested)."""
    if drafter.paired is None:
        raise FlexDraftError("parallel_forward needs the drafter paired with the target (Drafter.pair_with)")
    n, T = tokens.shape
    m = anchors.shape[1]
    dev = tokens.device
    e = drafter.config.entry_layer
    span, N = int(pos.max()) + 1, m * T
    base = pos[:, :1] + anchors  # [n, m]: position of verify token a (the branch's last visible one)
    bpos = (base[:, :, None] + 1 + torch.arange(T, device=dev)).reshape(n, N)  # [n, N]
    block_of = torch.arange(m, device=dev).repeat_interleave(T).expand(n, -1)
    scratch = (span + torch.arange(N, device=dev)).expand(n, N)  # [n, N] cache slots of the branch tokens
    same = block_of[:, :, None] == block_of[:, None, :]  # [n, N, N]
    in_block = {"causal": same & (bpos[:, None, :] <= bpos[:, :, None]), "bidirectional": same}
    # branch keys/values go to scratch slots span .. span+N-1, past every row's verify tokens (beyond the rows'
    # lengths: never visible to a later step, overwritten by later writes), so that one attention per layer
    # serves clean and branch queries over cache[:span + N] without copying the prefix:
    # clean rows see the cache causally and no branch key; branch rows see their prefix and their block
    clean = torch.cat(((torch.arange(span, device=dev) <= pos[..., None]), pos.new_zeros(n, T, N, dtype=torch.bool)), -1)
    ctx = torch.arange(span, device=dev) <= base.repeat_interleave(T, dim=1)[:, :, None]  # [n, N, span]
    masks = [target.attention_mask(torch.cat((clean, torch.cat((ctx, in_block[kind]), -1)), dim=1)[:, None])
             for kind in ("causal", drafter.config.tuned_attention)]  # [n, 1, T + N, span + N]
    x = target.embed_tokens(tokens)
    cos_all, sin_all = target.rope(torch.cat((pos, bpos), dim=1), x.dtype)  # [n, 1, T + N, D]
    if e:  # below the entry layer only the clean tokens run, exactly as in the target's forward
        clean_mask = target.attention_mask(clean[:, None, :, :span])
        x = target.run_layers(x, cos_all[:, :, :T], sin_all[:, :, :T], clean_mask, pos, span, cache, end=e)
    xx = torch.cat((x, drafter.mask_embedding.to(x.dtype).expand(n, N, -1)), dim=1)  # [n, T + N, d]
    is_clean = (torch.arange(T + N, device=dev) < T).expand(n, T + N)
    # clean keys/values at their positions, the branches' in the scratch slots; in the tuned layers the branches
    # use the drafter's projectors (both sets in one GEMM)
    xx = target.run_layers(xx, cos_all, sin_all, masks[0], torch.cat((pos, scratch), dim=1), span + N, cache,
                           start=e, tuned=drafter.tuned_layers(is_clean, masks[1]))
    h = target.norm(xx)
    return h[:, :T], h[:, T:].view(n, m, T, -1)
