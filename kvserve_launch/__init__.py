"""One command for the whole system on one machine: ``python -m kvserve_launch`` (``make run``)
starts the cache service, N workers and the gateway, and stops them all on Ctrl-C."""
