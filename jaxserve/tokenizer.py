"""Tokenizer from a checkpoint directory's `tokenizer.json` (+ optional chat template); never the network."""

from __future__ import annotations

import json
import os

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: not found; text prompts need the checkpoint's tokenizer.json "
                                    f"(token-id prompts work without it)")
        self._tok = _HFTokenizer.from_file(path)
        self.chat_template = None
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                self.config = json.load(f)
            self.chat_template = self.config.get("chat_template")
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                self.chat_template = f.read()

    @staticmethod
    def maybe_load(model_dir: str) -> "Tokenizer | None":
        return Tokenizer(model_dir) if os.path.isfile(os.path.join(model_dir, "tokenizer.json")) else None

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (the grammar engine builds its own from it)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja)")
        # a checkpoint's template is untrusted code: sandboxed, as transformers renders it
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self._special("bos_token"), eos_token=self._special("eos_token"))

    def _special(self, key: str) -> str:
        v = self.config.get(key) or ""
        return v.get("content", "") if isinstance(v, dict) else v
