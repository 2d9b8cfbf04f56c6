"""A/B ladder rows that are OpenAI-compatible servers (vLLM, SGLang, this project's engine over
HTTP, any other): the streaming client and its timings (stream.py), acceptance read from the
server (metrics.py: Prometheus counters; engines.py: what each engine reports and how), servers
the plugin starts and stops (managed.py), their definitions (servers.py) and the row the ladder
runner interleaves (rows.py). None of it is part of the gate core."""
