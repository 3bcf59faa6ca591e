"""The synthetic checkpoints' tokenizer: a byte-level BPE of ``TOKENIZER_VOCAB``
ids trained on a short built-in corpus, with a chat template, and which of
its ids decode to whole printable text. With ``tool_calls``, Qwen3's way of
calling tools: ``<tool_call>`` and ``</tool_call>`` as tokens of their own
(added, not special), a chat template that offers the tools and renders
calls and their results (from which mlx-lm picks its ``json_tools``
parser), and JSON in the corpus."""

import json
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx

TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 2
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # ids 3 and 4 of a tool-calling tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3's template cut to what these checkpoints need (no thinking): the tools offered in the
# system turn, an assistant's calls as <tool_call> JSON, tool results in a user turn.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# JSON as tool calls write it, so that the merges of a tool-calling tokenizer hold its pieces.
TOOL_CORPUS = """\
{"name":"get_weather","arguments":{"city":"Paris"}}
{"name":"get_time","arguments":{"city":"Lima","zone":"local"}}
{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius"}}
{"type":"function","function":{"name":"get_weather","parameters":{"city":"string"}}}
{"name":"get_news","arguments":{"city":"Rome","topic":"weather"}}
{"name":"set_alarm","arguments":{"time":"9:30","name":"wake"}}
"""

CORPUS = """\
The morning was cold and clear, and the river moved slowly past the old stone bridge.
A small boat drifted near the bank while two children watched the water and talked about
the fish they hoped to catch. Their mother called them home for breakfast, and they ran up
the hill through the tall grass, laughing and shouting all the way to the kitchen door.
Hello world! This is the first program that many people write when they learn a new language.
It prints a short greeting and then it stops. Simple programs like this one help us check
that the computer, the compiler and the tools are working together as they should.
A mixture of experts model sends each token to a few experts chosen by a small router.
Only the selected experts do any work, so the model can hold many parameters while the
cost of each step stays low. When the experts live on different machines, the tokens must
travel across the network, and the results must come back in the right order.
In the evening the market was full of people buying bread, cheese, apples and fresh flowers.
The baker had been working since four o'clock, and his hands were white with flour. He smiled
at every customer and wrapped each loaf in brown paper before handing it over the counter.
Good questions are often more useful than quick answers. What is the problem we want to solve?
Which parts of it do we already understand, and which parts are still unknown? Writing the
answers down, one line at a time, makes it much easier to see the next step and to share it.
The weather changed quickly that afternoon. Dark clouds rolled in from the west, the wind
picked up, and soon heavy rain was falling on the roofs and streets of the quiet town.
People hurried inside, and the cats found warm places under the porches to wait for the sun.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in text, along with dates, times like
9:30, prices like $5.99, and small lists: first, second, third; north, south, east and west.
Every good story has a beginning, a middle and an end. The characters want something, they
face a problem, and they change along the way. Readers keep turning the pages because they
want to know what will happen next, and whether the hero will find the way back home again.
"""


def write_tokenizer(path: Union[str, Path], vocab_size: Optional[int] = None, tool_calls: bool = False) -> None:
    """Train a byte-level BPE tokenizer on the built-in corpus and save it.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json``. The vocabulary has ``TOKENIZER_VOCAB`` entries;
    a larger ``vocab_size`` pads it with unreachable ``<|reserved_N|>`` tokens
    so that every id a model can emit still decodes. ``tool_calls``: Qwen3's
    tool-call tokens (``TOOL_TOKENS``, ids 3 and 4), ``TOOL_CHAT_TEMPLATE``
    and ``TOOL_CORPUS`` in the training text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS + (TOOL_TOKENS if tool_calls else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = CORPUS + (TOOL_CORPUS if tool_calls else "")
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() != TOKENIZER_VOCAB:
        raise RuntimeError(f"Trained vocab has {tok.get_vocab_size()} tokens.")
    content = json.loads(tok.to_str())
    for added in content["added_tokens"]:
        added["special"] = added["content"] not in TOOL_TOKENS  # as Qwen3's: decoded, never skipped
    vocab = content["model"]["vocab"]
    for i in range(TOKENIZER_VOCAB, vocab_size or 0):
        vocab[f"<|reserved_{i}|>"] = i
    with open(path / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(content, f, ensure_ascii=False)

    special = {"eos_token": SPECIAL_TOKENS[EOS_ID], "pad_token": SPECIAL_TOKENS[0]}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "unk_token": None,
        **special,
        "additional_special_tokens": [SPECIAL_TOKENS[1]],
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": TOOL_CHAT_TEMPLATE if tool_calls else CHAT_TEMPLATE,
    }
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    with open(path / "special_tokens_map.json", "w") as f:
        json.dump(special, f, indent=2)


def printable_rows(path: Path, vocab_size: int) -> mx.array:
    """[vocab_size] bool: the ids of the tokenizer at ``path`` that decode to
    whole printable text (not special, reserved, partial UTF-8 or control bytes)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    keep = [False] * vocab_size
    for i in range(min(vocab_size, TOKENIZER_VOCAB)):
        s = tok.decode([i])
        keep[i] = bool(s) and s.replace("\n", " ").isprintable() and "\ufffd" not in s
    return mx.array(keep)
