"""The apps of serve/config.yaml for the side-by-side loadtest, one replica of 1 CPU (1 engine thread) each:
learned (the default planner) at /, static (engine.online: false, the planner before it learned) at /static, AR at
/ar and AR again at /ar2 (the noise floor).
    python apps.py REPO FLEXDRAFT_HOME DRAFTER STORE [APP ...] > serve.yaml   (APP: a subset, e.g. learned)"""
import copy
import sys

import yaml

if __name__ == "__main__":
    repo, home, drafter, store, *only = sys.argv[1:]
    cfg = yaml.safe_load(open(f"{repo}/serve/config.yaml"))
    base = cfg["applications"][0]
    base["runtime_env"]["env_vars"]["FLEXDRAFT_HOME"] = home
    d = base["deployments"][0]
    d["autoscaling_config"].update(min_replicas=1, max_replicas=1)  # one replica each: a stable measurement
    d["ray_actor_options"] = {"num_cpus": 1}
    d["user_config"].update(drafter=drafter, store=store, served_model_name="smollm2")
    apps = []
    for name, route, engine in (("learned", "/", {}), ("static", "/static", {"online": False}),
                                ("ar", "/ar", {"mode": "ar"}), ("ar2", "/ar2", {"mode": "ar"})):
        if only and name not in only:
            continue
        a = copy.deepcopy(base)
        a.update(name=name, route_prefix=route)
        a["deployments"][0]["user_config"]["engine"].update(engine)
        apps.append(a)
    cfg["applications"] = apps
    yaml.safe_dump(cfg, sys.stdout, sort_keys=False)
