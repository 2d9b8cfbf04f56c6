# Sourced by the GPU scripts: PYTEST, the pytest command they run on the CUDA device, naming the
# gate core's and the MoE harness's plugins (`-p pytest_moeperf.plugin -p moe_harness.plugin`) only
# where the package is not installed (a bare GPU image with the repository on PYTHONPATH): an
# installed package registers them itself, and naming one twice is an error.
MOEPERF_PLUGIN=$(python3 -c "from importlib.metadata import entry_points as eps
print('' if any(e.value == 'pytest_moeperf.plugin' for e in eps(group='pytest11')) else '-p pytest_moeperf.plugin -p moe_harness.plugin')")
PYTEST="python3 -m pytest -q -p no:cacheprovider $MOEPERF_PLUGIN --moe-device cuda"
