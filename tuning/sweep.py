"""Ray Tune sweeps (docs/tuning.md): decode-time settings over one drafter, or training-time settings with one
drafter trained per trial; the result is a policy file for `flexdraft generate --policy`, the benchmark harness
and the Serve app. The driver is `flexdraft.tuning.tuner`.

    python tuning/sweep.py --config tuning/configs/decode.yaml [--drafter PATH] [--resume]
    flexdraft sweep --config tuning/configs/training.yaml
    ray job submit --working-dir . -- python tuning/sweep.py --config tuning/configs/decode.yaml
"""
from flexdraft.tuning.tuner import main

if __name__ == "__main__":
    main(prog="tuning/sweep.py")
