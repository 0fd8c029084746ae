"""A drafter as an MLflow model: `log_model.log_drafter_model` logs a drafter folder as a pyfunc whose code is
`pyfunc.py` (its `predict` answers with the adaptive engine). Above the engine, below what trains and serves."""
