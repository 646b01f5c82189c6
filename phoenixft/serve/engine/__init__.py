"""The inference engine: requests in, tokens out, one ``step()`` at a time, in one process.

Read it in this order (nano-vllm's shape): ``sequence`` (one request's tokens and
progress), ``block_manager`` (paged KV blocks, prefix sharing), ``scheduler`` (continuous
batching, preemption), ``runner`` (the KV tensors, a step's forward through ``model``,
weights from ``loader``), ``llm_engine`` (the step loop, sampling by ``sampler``, stop
handling), ``llm`` (the offline API). Around them: ``config``, ``spec`` (a model without
its weights, what the HTTP front validates requests with), ``tokenizer``, ``adapters``.

This part knows nothing of the recovery log or of HTTP: it sees the log only through
``step_recorder.StepRecorder``. Nothing is imported here, so importing a module of this
package does not import its siblings.
"""
