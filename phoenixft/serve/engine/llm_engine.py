"""The engine: requests in, token deltas out, one ``step()`` at a time.

``LLMEngine`` is single-threaded by design: only the thread that calls ``step()`` may call
``add_request``/``abort`` (the HTTP server funnels its calls through one engine thread).

Crash recovery sees the engine through two doors: a `StepRecorder` (step_recorder.py)
that it calls after every step, which reads what the step changed (the block manager's
dirty slots, the requests' progress), and ``install()``, through which an engine rebuilt
from the recovery log takes the logged requests over (their KV already scattered back).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .adapters import AdapterStore, check_adapter_name, read_adapter_file
from .block_manager import BlockManager
from .config import EngineConfig, SamplingParams
from .loader import load_model
from .runner import ModelRunner
from .sampler import logprobs, penalize, sample
from .scheduler import Scheduler
from .sequence import Sequence
from .spec import EngineSpec
from .step_recorder import StepRecorder


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: the new tokens and the text they made."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_completion_tokens: int
    prompt_computed: int = 0  # prompt tokens this engine computed for the request so far
    # per new token, when the request asked: (its logprob, [(token, logprob)] top-k)
    logprobs: list | None = None


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.spec = EngineSpec(self.model_dir, config)
        model_config, model = load_model(self.model_dir, self.spec.config.torch_dtype)
        self.model_config, self.tokenizer = model_config, self.spec.tokenizer
        self.config = self.spec.config
        self.block_manager = BlockManager(self.config.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.runner = ModelRunner(model, self.model_config, self.config)
        self.seqs: dict[str, Sequence] = {}
        self.num_generated_tokens = 0
        self.step_prompt_tokens = 0  # prompt tokens the last step computed (its chunks)
        self._last_step: list[Sequence] = []  # what the current or last step computes
        self._before: list[tuple[int, int]] = []  # their (tokens, computed) before it
        # what records each step (the recovery log, when serving keeps one): step_recorder.py
        self.recorder: StepRecorder | None = None
        self.adapters = AdapterStore()
        self.runner.adapters = self.adapters

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len  # type: ignore[return-value]

    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      keep_logits: bool = False, add_special_tokens: bool = True) -> Sequence:
        """Tokenize and validate a request without touching engine state, so any thread
        may call it (`EngineSpec.make_sequence`)."""
        return self.spec.make_sequence(request_id, prompt, params, keep_logits,
                                       add_special_tokens)

    def load_adapter(self, name: str, path: str | Path, *, replace: bool = False) -> int:
        """Load the adapter `name` from a file (or, with `replace`, make a new version of
        one that exists); returns its version. Requests admitted from now on use it;
        running ones keep theirs. Everything is checked before anything changes (the name,
        the file, and that the recovery log can hold it), so a refused load (ValueError)
        leaves the engine as it was."""
        check_adapter_name(name)
        if name in self.adapters.current and not replace:
            raise ValueError(f"an adapter named {name!r} is already loaded; to replace it, "
                             "load it as a replacement (HTTP: \"load_inplace\": true; "
                             "Python: replace=True)")
        tensors, scale = read_adapter_file(path, self.model_config)
        adapter = self.adapters.next_version(name, tensors, scale)
        payload = self.recorder.adapter_payload(adapter) if self.recorder is not None else None
        self.adapters.install(adapter)
        if payload is not None:
            self.recorder.log_adapter(payload)
        return adapter.version

    def add_sequence(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"request id {seq.seq_id!r} is already in use")
        if seq.adapter is not None:
            if seq.adapter not in self.adapters.current:
                raise ValueError(f"no adapter named {seq.adapter!r} is loaded")
            if not seq.adapter_version:  # pinned at admission (resumed ones keep theirs)
                seq.adapter_version = self.adapters.current[seq.adapter]
            if (seq.adapter, seq.adapter_version) not in self.adapters.versions:
                raise ValueError(f"adapter {seq.adapter!r} version {seq.adapter_version} is "
                                 "no longer loaded")
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    keep_logits: bool = False, add_special_tokens: bool = True,
                    adapter: str | None = None) -> Sequence:
        """Validate and queue a request (``make_sequence`` then ``add_sequence``)."""
        seq = self.make_sequence(request_id, prompt, params, keep_logits, add_special_tokens)
        seq.adapter = adapter
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def warm_up(self) -> None:
        """Pay first-call costs now (kernels, allocator), not when a request or a takeover
        is waiting: one short generation, then every block free again."""
        self.add_request("__warmup__", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0,
                                                                 ignore_eos=True))
        while self.has_unfinished():
            self.step()
        self.block_manager.rebuild([])

    def step(self) -> list[RequestOutput]:
        self.step_prompt_tokens = 0
        seqs = self._last_step = self.scheduler.schedule()
        self._before = [(len(s.token_ids), s.num_computed_tokens) for s in seqs]
        outputs = self._compute(seqs) if seqs else []
        if self.recorder is not None:
            self.recorder.end_step()
        if len(self.adapters.versions) > len(self.adapters.current):
            self.adapters.prune({(s.adapter, s.adapter_version) for s in self.seqs.values()
                                 if s.adapter})
        return outputs

    def install(self, waiting: list[Sequence], running: list[Sequence]) -> None:
        """Take over requests rebuilt from the recovery log (their KV already written into
        the cache): queues in the recorded order, the allocator rebuilt from their block
        tables, the text emitted so far decoded again from their tokens."""
        for s in (*waiting, *running):
            ids = s.completion_token_ids
            s.output_text = self.tokenizer.decode(ids)
        self.seqs = {s.seq_id: s for s in (*running, *waiting)}
        self.scheduler.waiting = deque(waiting)
        self.scheduler.running = deque(running)
        self.block_manager.rebuild([s.block_table for s in (*running, *waiting)])

    def _compute(self, seqs: list[Sequence]) -> list[RequestOutput]:
        starts = [s.num_computed_tokens for s in seqs]
        logits = self.runner.run(seqs)
        done = []  # the rows whose every token is now computed: they sample one more
        for i, (s, start) in enumerate(zip(seqs, starts)):
            end = start + s.new_tokens
            self.block_manager.mark_computed(s, start, end)
            prompt = max(0, min(end, s.num_prompt_tokens) - start)
            s.prompt_computed += prompt
            self.step_prompt_tokens += prompt
            s.num_computed_tokens, s.num_new_tokens = end, 0
            if end == len(s):
                done.append(i)
        if len(done) < len(seqs):  # a prompt's chunk: no token yet
            logits, seqs = logits[done], [seqs[i] for i in done]
            if not seqs:
                return []
        tokens = sample(penalize(logits, seqs), seqs)
        lps = logprobs(logits, seqs, tokens)
        now = time.monotonic()
        outputs = []
        for i, (s, tok) in enumerate(zip(seqs, tokens)):
            if s.keep_logits:
                s.logits.append(logits[i].clone())
            if s.first_token_time is None:
                s.first_token_time = now
            s.token_ids.append(tok)
            self.num_generated_tokens += 1
            out = self._postprocess(s, tok)
            if lps[i] is not None:
                out.logprobs = [lps[i]]
            outputs.append(out)
        return outputs

    def isolate_failed_step(self) -> tuple[list[RequestOutput], list[str]]:
        """After `step()` raised: compute that step's requests again one at a time, from
        where they stood before it; a request that raises alone is finished as "error"
        (its blocks freed). Returns (outputs of the requests that went through, ids of
        the failed ones). Requests outside that step are untouched."""
        outs, failed = [], []
        for s, (n_tokens, n_computed) in zip(self._last_step, self._before):
            if self.seqs.get(s.seq_id) is not s:
                continue
            del s.token_ids[n_tokens:]
            del s.emitted[max(0, n_tokens - s.num_prompt_tokens):]
            s.num_computed_tokens = n_computed
            try:
                outs += self._compute([s])
            except Exception:
                self.seqs.pop(s.seq_id, None)
                self.scheduler.finish(s, "error")
                failed.append(s.seq_id)
        self._last_step, self._before = [], []
        return outs, failed

    def _postprocess(self, s: Sequence, tok: int) -> RequestOutput:
        p = s.params
        reason = None
        ids = s.completion_token_ids
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tokenizer.eos_token_ids):
            reason, ids = "stop", ids[:-1]
        s.output_text = self.tokenizer.decode(ids)
        if p.stop:
            hit = self._find_stop(s.output_text, p.stop, s.num_emitted_chars)
            if hit is not None:
                s.output_text, reason = s.output_text[:hit], "stop"
        if reason is None and (s.num_completion_tokens >= p.max_tokens
                               or len(s) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(s, reason)
            self.seqs.pop(s.seq_id, None)
            end = len(s.output_text)
        else:
            end = self._safe_end(s.output_text, p.stop)
        end = max(end, s.num_emitted_chars)
        delta = s.output_text[s.num_emitted_chars:end]
        s.num_emitted_chars = end
        s.emitted.append(end)
        return RequestOutput(s.seq_id, [tok], delta, reason is not None, reason,
                             s.num_prompt_tokens, s.num_completion_tokens, s.prompt_computed)

    @staticmethod
    def _find_stop(text: str, stops: list[str], emitted: int) -> int | None:
        start = max(0, emitted - max(map(len, stops)))
        hits = [i for i in (text.find(st, start) for st in stops) if i >= 0]
        return min(hits) if hits else None

    @staticmethod
    def _safe_end(text: str, stops: list[str]) -> int:
        """Hold back text that may still become a stop string or an incomplete character."""
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        safe = end
        for st in stops:
            for k in range(min(len(st) - 1, end), 0, -1):
                if text.endswith(st[:k], 0, end):
                    safe = min(safe, end - k)
                    break
        end = safe
        return end
