"""The MoE harness: what pytest-moeperf's gate core (`pytest_moeperf`) gates on a Mixture-of-Experts
decode. Options of the model, MoE backend, LM head and ladder; the `moe_model` and `moe_backend`
fixtures; the figures' tolerances; and the A/B ladder (`ladder/`), whose rows are this project's
engine (`impl.serve`) or OpenAI-compatible servers (`ladder/endpoints/`). Registered by its own
pytest11 entry point; it feeds the core through the hooks of `pytest_moeperf.hookspec`."""
