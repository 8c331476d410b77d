"""kvelastic_* metrics on vLLM's Prometheus ``/metrics``, in one process or from multiprocess files."""
