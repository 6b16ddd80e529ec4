"""The capture's progress bar."""
from __future__ import annotations

import sys


class PromptProgress:
    """The capture's progress bar, in prompts, moving with every generated token: a batch of b
    prompts adds b / max_new_tokens a decode step (counted by a logits processor, which runs on the
    model's thread without a device sync), and the bar is set to the prompts done after each batch
    (one that stopped early at its eos token included)."""

    def __init__(self, total: int, max_new_tokens: int, disable: bool):
        from tqdm import tqdm
        self.per_step = self.limit = 0.0
        self.max_new_tokens = max_new_tokens
        self.bar = tqdm(total=total, unit="prompt", desc="capture", file=sys.stderr, disable=disable,
                        dynamic_ncols=True, mininterval=0.2,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total} prompts [{elapsed}<{remaining}]")

    def processors(self):
        from transformers import LogitsProcessor, LogitsProcessorList
        progress = self

        class _Step(LogitsProcessor):
            def __call__(self, input_ids, scores):
                progress.step()
                return scores
        return LogitsProcessorList([_Step()])

    def batch(self, prompts: int) -> None:
        self.per_step = prompts / self.max_new_tokens
        self.limit = self.bar.n + prompts           # (float steps never run past the batch)

    def step(self) -> None:
        k = min(self.per_step, self.limit - self.bar.n)
        if k > 0:
            self.bar.update(k)

    def done(self, prompts: int) -> None:
        self.bar.n = prompts
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
