"""What the tests share: running real jobs and cleaning up after them (`jobs`), two
"hosts" in network namespaces (`netns`), waiting for a state with a deadline and free
loopback ports (`waiting`), a real `phoenixft serve` and its clients (`serving`), and
the serving engine's test-only state helpers (`async_engine`, `engine_state`)."""
