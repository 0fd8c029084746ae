"""Two apps of serve/config.yaml for the side-by-side loadtest: adaptive at /, the same with mode ar at /ar.
   python two_apps.py REPO FLEXDRAFT_HOME THREADS > serve.yaml"""
import copy
import sys

import yaml

if __name__ == "__main__":
    repo, home, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = yaml.safe_load(open(f"{repo}/serve/config.yaml"))
    base = cfg["applications"][0]
    base["runtime_env"]["working_dir"] = f"local://{repo}"
    base["runtime_env"]["env_vars"]["FLEXDRAFT_HOME"] = home
    d = base["deployments"][0]
    d["autoscaling_config"].update(min_replicas=1, max_replicas=1)   # one replica each: a stable measurement
    d["ray_actor_options"] = {"num_cpus": 1}                         # both fit on the 2-CPU local instance
    d["user_config"]["runtime"]["threads"] = threads
    apps = []
    for name, route, mode in (("adaptive", "/", "adaptive"), ("ar", "/ar", "ar")):
        a = copy.deepcopy(base)
        a.update(name=name, route_prefix=route)
        a["deployments"][0]["user_config"]["engine"]["mode"] = mode
        apps.append(a)
    cfg["applications"] = apps
    yaml.safe_dump(cfg, sys.stdout, sort_keys=False)
