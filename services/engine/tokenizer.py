"""Tokenizer, incremental detokenisation with stop strings, and chat templates.

A checkpoint without `tokenizer.json` runs in token-id mode (like vLLM's skip_tokenizer_init):
`Tokenizer.from_dir` returns None and callers must pass token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

# Used when the checkpoint's tokenizer_config.json has no chat_template: DeepSeek-V3's format
# (turn markers, tool calls and tool outputs as DeepSeek-V3-0324 writes them).
DEFAULT_CHAT_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(in_tool=false, first_output=true) %}
{%- for m in messages if m['role'] == 'system' %}{{ m['content'] }}

{% endfor %}
{%- for m in messages if m['role'] != 'system' %}
{%- if m['role'] != 'tool' and ns.in_tool %}<｜tool▁outputs▁end｜>{% set ns.in_tool = false %}{% endif %}
{%- if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% set ns.first_output = true %}
{%- elif m['role'] == 'assistant' %}
{%- set content = (m['content'] or '').split('</think>')[-1] %}
{%- if not ns.first_output %}{{ content }}{% else %}<｜Assistant｜>{{ content }}{% endif %}
{%- if m['tool_calls'] %}<｜tool▁calls▁begin｜>
{%- for c in m['tool_calls'] %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c['function']['name'] }}
```json
{{ c['function']['arguments'] }}
```<｜tool▁call▁end｜>{% if not loop.last %}{{ '\n' }}{% endif %}{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>
{%- set ns.first_output = true %}
{%- elif m['role'] == 'tool' %}
{%- if not ns.in_tool %}<｜tool▁outputs▁begin｜>{% else %}{{ '\n' }}{% endif %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>
{%- set ns.in_tool = true %}{% set ns.first_output = false %}
{%- endif %}
{%- endfor %}
{%- if ns.in_tool %}<｜tool▁outputs▁end｜>{% endif %}
{%- if add_generation_prompt and ns.first_output %}<｜Assistant｜>{% endif %}"""

# The tools a request offers, described to the model in its system prompt (DeepSeek's official
# V3/R1 templates render tool calls and outputs but not the tools themselves).
TOOLS_PROMPT = """## Tools
You have access to the following tools:
{% for t in tools %}
### {{ t['function']['name'] }}
Description: {{ t['function']['description'] }}

Parameters: {{ t['function']['parameters'] | tojson }}
{% endfor %}

IMPORTANT: ALWAYS adhere to this exact format for tool use:
<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_name
```json
arguments
```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"""

# DeepSeek's reasoning and tool-call markers (in its vocabulary as ordinary, not special, tokens:
# they stay in decoded text, where the router parses them).
MARKER_TOKENS = [
    "<think>", "</think>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
]  # fmt: skip


def read_template(template: str) -> str:
    """A chat template given as a file's path or inline (vLLM's --chat-template takes either)."""
    path = Path(template)
    if "{" not in template and path.is_file():
        return path.read_text()
    if "{" not in template:
        raise ValueError(f"chat template {template!r}: no such file, and not a Jinja template")
    return template


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_token: str | None, eos_token: str | None, chat_template: str):
        self._tok = tok
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id = tok.token_to_id(bos_token) if bos_token else None
        self.chat_template = chat_template
        self._template = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer | None:
        """The checkpoint's tokenizer; `chat_template` (a Jinja template, or the path of a file
        holding one: vLLM's --chat-template) in place of its tokenizer config's."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        cfg_path = model_dir / "tokenizer_config.json"
        tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

        def token_str(v):
            return v.get("content") if isinstance(v, dict) else v

        return cls(
            HFTokenizer.from_file(str(path)),
            token_str(tcfg.get("bos_token")),
            token_str(tcfg.get("eos_token")),
            read_template(chat_template)
            if chat_template
            else tcfg.get("chat_template") or DEFAULT_CHAT_TEMPLATE,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def to_json(self) -> str:
        """The tokenizer as Hugging Face `tokenizers` JSON (what grammar engines read)."""
        return self._tok.to_str()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """A readable, unique string for one token (for logprobs): its decoded text, or its
        vocabulary entry when it alone is not valid UTF-8 (a fragment of a character)."""
        text = self._tok.decode([token], skip_special_tokens=False)
        return text if text and "\ufffd" not in text else (self._tok.id_to_token(token) or f"<{token}>")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt text of a conversation; `tools`: OpenAI tool definitions the model may call
        (described in the system prompt unless the template renders `tools` itself)."""
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
            self._tools_prompt = env.from_string(TOOLS_PROMPT)
        if tools and "tools" not in self.chat_template:
            described = self._tools_prompt.render(tools=tools)
            if messages and messages[0]["role"] == "system":
                messages = [
                    {**messages[0], "content": f"{messages[0]['content']}\n\n{described}"},
                    *messages[1:],
                ]
            else:
                messages = [{"role": "system", "content": described}, *messages]
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class Detokenizer:
    """Turns a growing list of output token ids into text deltas, and finds stop strings.

    Text that may still change (an incomplete UTF-8 sequence) or may be the start of a stop
    string is held back until it is certain. Incremental, as vLLM's: each step decodes only a
    window of tokens (those since the last certain text, and the ones before them that a
    decoder's context may need: `prefix`..), so a long output costs linear time, not quadratic.
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: list[str], earlier_ids: list[int] = (), earlier_sent: int = 0
    ):
        """earlier_ids / earlier_sent: a resumed request's output so far (produced elsewhere) and
        how many of its characters were already emitted: text continues from there."""
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids = list(earlier_ids)  # every token so far (the earlier ones, then this request's)
        self.earlier = len(self.ids)
        self.sent = earlier_sent  # characters already emitted
        # certain text: `done` = decode(ids[:read]); the next window starts at `prefix` <= read
        # (a char boundary: done never ends inside a character)
        start = max(0, self.earlier - 4)  # (a character is at most 4 byte-level tokens)
        while start > 0 and tokenizer.decode(self.ids[:start]).endswith("\ufffd"):
            start -= 1
        self.prefix = self.read = start
        self.done = tokenizer.decode(self.ids[:start]) if start else ""
        self.text = ""

    def step(self, output_ids: list[int], final: bool) -> tuple[str, bool]:
        """Returns (new text, stopped). When stopped, the text ends before the stop string."""
        self.ids += output_ids[len(self.ids) - self.earlier :]
        prefix_text = self.tokenizer.decode(self.ids[self.prefix : self.read])
        window = self.tokenizer.decode(self.ids[self.prefix :])
        if window.startswith(prefix_text):
            self.text = self.done + window[len(prefix_text) :]
        else:  # (a decoder whose window text is not its prefix's continuation: decode it all)
            self.text = self.tokenizer.decode(self.ids)
        if not self.text.endswith("\ufffd"):  # certain up to here: the next window starts at `read`
            self.done, self.prefix, self.read = self.text, self.read, len(self.ids)
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        if hits:  # stop at the earliest stop string
            self.text = self.text[: min(hits)]
            return self._emit(len(self.text)), True
        stable = len(self.text) if final else len(self.text.rstrip("\ufffd")) - self.hold
        return self._emit(stable), False

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta
