"""Two apps of serve/config.yaml for the side-by-side loadtest of a policy file: the engine's defaults at /, the
same with user_config.policy at /tuned (one replica each, 1 CPU each).
   python serve_ab.py REPO FLEXDRAFT_HOME POLICY > serve.yaml"""
import copy
import sys

import yaml

from flexdraft.policy_file import POLICY_KEYS

repo, home, policy = sys.argv[1:4]
cfg = yaml.safe_load(open(f"{repo}/serve/config.yaml"))
base = cfg["applications"][0]
base["runtime_env"]["working_dir"] = f"local://{repo}"
base["runtime_env"]["env_vars"]["FLEXDRAFT_HOME"] = home
d = base["deployments"][0]
d["autoscaling_config"].update(min_replicas=1, max_replicas=1)   # one replica each: a stable measurement
d["ray_actor_options"] = {"num_cpus": 1}                         # both fit on the 2-CPU local instance
default, tuned = copy.deepcopy(base), copy.deepcopy(base)
default.update(name="default", route_prefix="/")
tuned.update(name="tuned", route_prefix="/tuned")
uc = tuned["deployments"][0]["user_config"]
uc["policy"] = policy
uc["engine"] = {k: v for k, v in uc["engine"].items() if k not in POLICY_KEYS}  # the policy sets these
cfg["applications"] = [default, tuned]
yaml.safe_dump(cfg, sys.stdout, sort_keys=False)
