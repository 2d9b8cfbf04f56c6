"""The A/B ladder inside a suite: serve a workload once per row, interleaved (`run`), summarize the
paired figures once (`summary`), and write the report (`report`, `figures`). Rows that are
OpenAI-compatible servers live in `endpoints/`."""
