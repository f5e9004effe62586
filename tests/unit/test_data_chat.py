"""Chat tokenization: the loss mask covers exactly the assistant contents and their end-of-turn token."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash.data.chat import CUT_AT_MAX_TOKENS, MalformedConversation, prompt_ids, tokenize_conversation

# The Qwen3 chat template without the tool branches: earlier assistant turns lose their <think>
# part, the last one always gets a (possibly empty) think block, enable_thinking=False adds it to
# the generation prompt.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or reasoning_content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@pytest.fixture
def tok(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def masked_text(tok, messages, **kw) -> list[str]:
    """The supervised runs of the mask, decoded (one string per contiguous run of mask 1)."""
    ids, mask = tokenize_conversation(tok, messages, **kw)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def conv(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_single_turn_masks_content_and_end_token(tok):
    msgs = conv(("user", "Continue:\nimport os"), ("assistant", "def f(x):\n    return x"))
    ids, mask = tokenize_conversation(tok, msgs)
    assert ids == list(tok.apply_chat_template(msgs)["input_ids"])  # same tokens as the template path
    assert masked_text(tok, msgs) == ["def f(x):\n    return x<|im_end|>"]
    # the prompt is a prefix of the training sample and entirely unsupervised
    p = prompt_ids(tok, msgs)
    assert ids[: len(p)] == p and not any(mask[: len(p)])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids[-1] != end and mask[-1] == 0  # the "\n" after <|im_end|> is not supervised
    assert ids[-2] == end and mask[-2] == 1


def test_a_turn_cut_at_max_tokens_has_no_supervised_end_token(tok):
    """A turn marked ``cut_at_max_tokens`` (finish reason ``length``): the template still closes it
    with <|im_end|>, which the target never wrote there, so only its content is supervised; the
    same tokens come out, and a later turn that ended on its own keeps its end token."""
    msgs = conv(("user", "one"), ("assistant", "cut off in the mid"), ("user", "two"), ("assistant", "done"))
    cut = [dict(m) for m in msgs]
    cut[1][CUT_AT_MAX_TOKENS] = True
    ids, mask = tokenize_conversation(tok, msgs)
    cut_ids, cut_mask = tokenize_conversation(tok, cut)
    assert cut_ids == ids
    assert masked_text(tok, msgs) == ["cut off in the mid<|im_end|>", "done<|im_end|>"]
    assert masked_text(tok, cut) == ["cut off in the mid", "done<|im_end|>"]
    (diff,) = [i for i, (a, b) in enumerate(zip(mask, cut_mask, strict=True)) if a != b]
    assert ids[diff] == tok.convert_tokens_to_ids("<|im_end|>") and (mask[diff], cut_mask[diff]) == (1, 0)
    assert diff < max(i for i, m in enumerate(mask) if m)  # the first turn's end, not the last one's
    cut[1][CUT_AT_MAX_TOKENS] = "yes"
    with pytest.raises(MalformedConversation, match="cut_at_max_tokens='yes'; expected true or false"):
        tokenize_conversation(tok, cut)


def test_system_and_multi_turn(tok):
    msgs = conv(
        ("system", "You are terse."),
        ("user", "one"),
        ("assistant", "first answer"),
        ("user", "two"),
        ("assistant", "assistant"),  # content equal to the role name: must not match the header
    )
    assert masked_text(tok, msgs) == ["first answer<|im_end|>", "assistant<|im_end|>"]
    assert masked_text(tok, msgs, train_only_last_turn=True) == ["assistant<|im_end|>"]
    p = prompt_ids(tok, msgs)
    assert tok.decode(p).endswith("<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n")


def test_no_assistant_gives_empty_mask(tok):
    ids, mask = tokenize_conversation(tok, conv(("user", "hello")))
    assert ids and not any(mask)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "not a list",
        [{"role": "user"}],
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": ["a", "b"]}],
        [{"content": "x"}],
        ["user: hi"],
    ],
)
def test_malformed_raises(tok, messages):
    with pytest.raises(MalformedConversation):
        tokenize_conversation(tok, messages)
    assert issubclass(MalformedConversation, ValueError)


def test_qwen3_template_with_thinking(tok):
    """The mask starts where the generation prompt ends, with the same template kwargs: with
    thinking off the empty think block is part of the prompt; with thinking on the model writes
    it, so it is supervised. Either way prompt + supervised tokens = the training sample."""
    tok.chat_template = QWEN3_TEMPLATE
    msgs = conv(
        ("system", "sys"),
        ("user", "q1"),
        ("assistant", "<think>\nreason one\n</think>\n\nanswer one"),
        ("user", "q2"),
        ("assistant", "think"),  # also appears in the template's empty think block
    )
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert "reason one" not in text  # the template dropped the earlier turn's reasoning
    off = {"enable_thinking": False}
    assert masked_text(tok, msgs, **off) == ["answer one<|im_end|>", "think<|im_end|>"]
    assert masked_text(tok, msgs) == ["answer one<|im_end|>", "<think>\n\n</think>\n\nthink<|im_end|>"]
    for kwargs in (off, {}):
        ids, mask = tokenize_conversation(tok, msgs, train_only_last_turn=True, **kwargs)
        p = prompt_ids(tok, msgs, **kwargs)
        assert ids[: len(p)] == p and not any(mask[: len(p)]) and all(mask[len(p) : -1]) and mask[-1] == 0
    assert tok.decode(prompt_ids(tok, msgs, **off)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # reasoning in the last turn, inline or as reasoning_content, is written by the model: supervised
    msgs[-1]["content"] = "<think>\nstep\n</think>\n\nfinal"
    want = ["answer one<|im_end|>", "<think>\nstep\n</think>\n\nfinal<|im_end|>"]
    assert masked_text(tok, msgs) == masked_text(tok, msgs, **off) == want
    msgs[-1]["content"] = "<think>step</think>final"  # the template normalises the whitespace
    assert masked_text(tok, msgs) == want
    msgs[-1] = {"role": "assistant", "content": "final", "reasoning_content": "step"}
    tok.chat_template = QWEN3_TEMPLATE.replace(
        "{%- set reasoning_content = '' %}",
        "{%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' %}",
    )
    assert masked_text(tok, msgs) == want


def test_multi_turn_with_thinking_off_keeps_every_turn(tok):
    """Earlier turns have no think block, the last one has it: the header search must not skip
    from the first assistant turn to the last one."""
    tok.chat_template = QWEN3_TEMPLATE
    msgs = conv(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"), ("user", "q3"))
    msgs.append({"role": "assistant", "content": "a3"})
    assert masked_text(tok, msgs, enable_thinking=False) == ["a1<|im_end|>", "a2<|im_end|>", "a3<|im_end|>"]


def test_llama3_style_template(tok):
    tok.add_tokens(
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True
    )
    tok.chat_template = LLAMA3_TEMPLATE
    msgs = conv(
        ("system", "sys"),
        ("user", "hi"),
        ("assistant", "  hello world\n"),
        ("user", "again"),
        ("assistant", "ok"),
    )
    # content is trimmed by the template; only <|eot_id|> (not the next header) closes the turn
    assert masked_text(tok, msgs) == ["hello world<|eot_id|>", "ok<|eot_id|>"]
    ids, mask = tokenize_conversation(tok, msgs)
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>") and ids.count(ids[0]) == 1
    p = prompt_ids(tok, msgs)
    assert ids[: len(p)] == p
    assert tok.decode(p).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_assistant_missing_from_render_is_malformed(tok):
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(MalformedConversation, match="not in the chat-template text"):
        tokenize_conversation(tok, conv(("user", "a"), ("assistant", "b")))
