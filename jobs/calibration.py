"""Bonus-guided calibration MLP on the tuned, frozen drafter (Ray Train TorchTrainer + DeepSpeed).

    python jobs/calibration.py --config configs/smollm2.yaml
    ray job submit --working-dir . -- python jobs/calibration.py --config configs/smollm2.yaml
"""
from flexdraft.training.jobs import job_main

if __name__ == "__main__":
    job_main("calibration")
