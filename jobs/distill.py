"""Self-distillation data: the target answers ShareGPT prompts (Ray actors, resumable shards).

    python jobs/distill.py --config configs/smollm2.yaml
    ray job submit --working-dir . -- python jobs/distill.py --config configs/smollm2.yaml
"""
from flexdraft.training.jobs import job_main

if __name__ == "__main__":
    job_main("distill")
