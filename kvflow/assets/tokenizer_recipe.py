"""The tokenizer recipe of kvflow's own small checkpoints (the bundled models and the test fixtures).

A byte-level BPE split with Qwen2's pre-tokenization regex, and ChatML as the chat template, so
that one set of conventions covers tools/train_tiny.py and tests/fixtures/checkpoints.py.
"""

from __future__ import annotations

# Qwen2's (and, up to digit grouping, Llama-3's) pre-tokenization regex: words with one leading
# non-letter, single digits, punctuation runs, newlines, spaces. Runs of indentation stay one piece
# ("\s+(?!\S)"), which suits Python source.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML with a tools block and a role check (so `tojson` and `raise_exception` are exercised).
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\nYou can call these tools:\\n' }}\n"
    "{%- for tool in tools %}\n"
    "{{- tool | tojson }}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    # content may be absent (an assistant turn that only calls tools): render it as empty.
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | default('') + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
