"""The kvserve gateway: OpenAI-compatible REST and the workers' gRPC Generate on one address,
routing each request to the worker whose KV pool already holds the longest prefix."""
