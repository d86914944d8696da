"""A tiny llama-architecture GGUF with random weights, for a real ``llama-server`` in the tests (no download).

The model is nonsense by design: what the tests need is a real llama.cpp server doing real tokenization, chat
templating, sampling, grammar-constrained tool calls and context accounting on a model that loads in milliseconds.
Its parts, and why:

* arch ``llama``, 2 layers, ``n_embd`` 64, 4 heads, a 512-token training context (the tests run ``-c 512`` and send
  a prompt over it);
* an SPM (``llama``) tokenizer: ``<unk>``, ``<s>``, ``</s>``, ChatML's ``<|im_start|>`` / ``<|im_end|>`` as control
  tokens (``<|im_end|>`` ends a turn), the template's tags as user-defined tokens (matched whole), the 256 byte tokens
  (SPM's fallback for any byte), every printable ASCII character and the words of the template, the tool and the
  tests' prompts with their prefixes (SPM merges two pieces at a time), so that a prompt with a tool fits in 512;
* no space prefix: the text after a control token is tokenized as written, as the grammar of a forced tool call,
  which starts with the generation prompt ``<|im_start|>assistant\\n``, requires;
* sampling picks printable text (greedy, or the server's defaults with top-k 40): the byte, control and tag tokens,
  whitespace, ``,`` and ``<`` have fixed low logits and the rest random, wide ones, so answers are ASCII, and where
  a grammar leaves a choice (a tool call's JSON) the call closes and the turn ends rather than padding with spaces;
* a hand-set attention head and a bigram that make it call a tool when tools are offered and no call or result has
  come yet (:func:`weights`): llama.cpp's grammar for ``tool_choice: required`` lets any text come before the call,
  so random weights alone would write text until ``max_tokens`` and never call;
* a ChatML chat template with tools and tool calls in ``<tool_call>`` tags (the Hermes / Qwen 2.5 form, which
  llama.cpp's template analysis reads with ``--jinja``);
* seeded: the same file, byte for byte, on every run (:data:`SEED`).

``python tests/llamacpp/model.py OUT.gguf`` writes it (780 kB).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

SEED = 25
N_EMBD = 64
N_HEAD = 4
N_FF = 128
N_LAYER = 2
N_CTX_TRAIN = 512
MODEL_NAME = "tiergate-tiny-random"

# ChatML with tools, modelled on Qwen 2.5's template (Hermes tool calls): the tools as JSON in the system turn, an
# assistant's calls as {"name", "arguments"} objects in <tool_call> tags, tool results in a user turn. Its words are
# few: at about one token per short word here, a prompt with a tool must fit the tests' 512-token context
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\nCall a tool with its name and arguments as JSON in tool_call tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# the tags of the template, whole (user-defined tokens are matched before SPM splits the rest)
TAGS = ("<tool_call>", "</tool_call>", "<tools>", "</tools>", "<tool_response>", "</tool_response>")
# words of the template, the roles, the tests' tool and prompts: each a token, with or without a space before it
WORDS = ("system", "user", "assistant", "tool", "Tools", "Call", "name", "arguments", "function", "type",
         "description", "parameters", "properties", "object", "string", "enum", "required", "city", "get_weather",
         "Current", "weather", "in", "Oslo", "Paris", "Answer", "one", "word", "hello", "world", "the", "is", "What",
         "fast", "tier", "gate", "token", "stream", "answer", "random", "model", "strict", "false", "true", "with",
         "its", "and", "as", "JSON", "tags", "bridge", "count", "usage", "limit", "whole", "standard")

# gguf.TokenType's values (kept here so that importing this module does not need gguf)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def vocab() -> tuple[list[str], list[float], list[int]]:
    """The tokens, their SPM scores (a merge into a longer piece wins) and their types."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *TAGS]
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, CONTROL] + [USER_DEFINED] * len(TAGS)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(0x21, 0x7F)]
    for spelled in [w for word in WORDS for w in (word, "\u2581" + word)]:
        # SPM merges two pieces at a time: every prefix of a word is a piece too
        pieces += [p for p in (spelled[:n] for n in range(2, len(spelled) + 1)) if p not in pieces]
    tokens += pieces
    types += [NORMAL] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [float(len(p)) for p in pieces]
    return tokens, scores, types


# residual dimensions set by hand (the rest is random): a constant 1; "tools are offered" (<tools>); "a call or a
# result came since" (<tool_call>, <tool_response>); the tool head's output; "the token here is <tool_call>"
CONST, PLUS, MINUS, FLAG, AFTER_TAG = 60, 61, 62, 63, 59
RESERVED = slice(AFTER_TAG, N_EMBD)


def weights(tokens: list[str], types: list[int]) -> dict[str, np.ndarray]:
    """The tensors: random (seeded), but for what makes the model call a tool when it has one, and end its turn after.

    * The tool head (head 0 of layer 0): its query is CONST, its keys the markers PLUS and MINUS (dimension 14 of the
      16-wide head, the slowest-turning RoPE pair: under 0.2 rad apart over the whole context), so a position attends
      to the markers before it, if any. Its value is +1 for <tools> and -2 for a call or a result, written to FLAG,
      which the output row of <tool_call> reads: after a prompt that offers tools and holds no call, <tool_call> is
      by far the likeliest token; once a call is made, or its result is in, the least likely.
    * After <tool_call> (AFTER_TAG, read by the row of the ``\\n`` byte) comes ``\\n``, as Hermes' format has it.
    * Whitespace, ``,`` and ``<`` and the byte, control and tag tokens have fixed low logits (on CONST), the end of the
      turn and ``</tool_call>`` zero, the rest random and wide: text is printable ASCII, the end never comes by chance,
      and where a grammar (a tool call's JSON) allows a choice, the call closes and the turn ends rather than padding
      with spaces or starting another call.

    No layer but the tool head writes the reserved dimensions, so they hold what the embedding and the head put there.
    """
    rng = np.random.default_rng(SEED)
    n_vocab, head = len(tokens), N_EMBD // N_HEAD
    tid = tokens.index

    def normal(std: float, *shape: int) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    embd = normal(1.0, n_vocab, N_EMBD)
    embd[:, RESERVED] = 0.0
    embd[:, CONST] = 1.0
    embd[tid("<tools>"), PLUS] = 1.0
    embd[[tid("<tool_call>"), tid("<tool_response>")], MINUS] = 1.0
    embd[tid("<tool_call>"), AFTER_TAG] = 1.0
    out: dict[str, np.ndarray] = {"token_embd.weight": embd}
    for i in range(N_LAYER):
        # numpy shapes are ggml's reversed: (rows = outputs, columns = inputs)
        q, k, v = normal(0.15, N_EMBD, N_EMBD), normal(0.15, N_EMBD, N_EMBD), normal(0.15, N_EMBD, N_EMBD)
        attn_out, down = normal(0.1, N_EMBD, N_EMBD), normal(0.1, N_EMBD, N_FF)
        for m in (q, k, v):
            m[:, RESERVED] = 0.0
        attn_out[RESERVED, :] = 0.0
        down[RESERVED, :] = 0.0
        if i == 0:  # the tool head: rows 0..15 of q, k, v, columns 0..15 of the output
            q[:head], k[:head], v[:head], attn_out[:, :head] = 0.0, 0.0, 0.0, 0.0
            q[14, CONST] = k[14, PLUS] = k[14, MINUS] = 11.0  # a score of ~30 for a marker, 0 elsewhere
            v[0, PLUS], v[0, MINUS] = 1.0, -2.0
            attn_out[FLAG, 0] = 5.0
        out |= {f"blk.{i}.attn_norm.weight": np.ones(N_EMBD, dtype=np.float32), f"blk.{i}.attn_q.weight": q,
                f"blk.{i}.attn_k.weight": k, f"blk.{i}.attn_v.weight": v, f"blk.{i}.attn_output.weight": attn_out,
                f"blk.{i}.ffn_norm.weight": np.ones(N_EMBD, dtype=np.float32),
                f"blk.{i}.ffn_gate.weight": normal(0.15, N_FF, N_EMBD),
                f"blk.{i}.ffn_up.weight": normal(0.15, N_FF, N_EMBD), f"blk.{i}.ffn_down.weight": down}
    output = normal(1.0, n_vocab, N_EMBD)  # logits of std ~8 over the normed state: sampling is near greedy
    output[:, RESERVED] = 0.0
    fixed = {t: -40.0 for t, kind in zip(tokens, types, strict=True) if kind != NORMAL}
    fixed |= {"\u2581": -40.0, ",": -20.0, "<": -20.0, "<|im_end|>": 0.0, "</tool_call>": 0.0, "<tool_call>": -10.0}
    for token, logit in fixed.items():
        output[tid(token)] = 0.0
        output[tid(token), CONST] = logit
    output[tid("<tool_call>"), FLAG] = 20.0
    output[tid("<0x0A>"), AFTER_TAG] = 100.0
    out |= {"output_norm.weight": np.ones(N_EMBD, dtype=np.float32), "output.weight": output}
    return out


def write(path: Path) -> Path:
    """Write the model to ``path`` (deterministic: the same bytes every time)."""
    import gguf  # the test extra's; imported here so that the module's facts are readable without it

    tokens, scores, types = vocab()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(MODEL_NAME)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)  # ChatML models start with the template's first token, as Qwen's
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in weights(tokens, types).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
