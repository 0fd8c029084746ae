"""Attention tuning of the drafter (Ray Train TorchTrainer + DeepSpeed; checkpoints and resumes).

    python jobs/attn_tuning.py --config configs/smollm2.yaml
    ray job submit --working-dir . -- python jobs/attn_tuning.py --config configs/smollm2.yaml
"""
from flexdraft.training.jobs import job_main

if __name__ == "__main__":
    job_main("attention")
