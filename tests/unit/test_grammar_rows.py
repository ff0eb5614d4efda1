"""GrammarRows (structured/matchers.py), the batched path, against one plain xgrammar matcher per row replaying
the row's output: the same logits masked in every case the engine meets (new tokens one per row or several,
drafts accepted, a draft the grammar refuses, a terminated matcher, a row without a grammar in the batch, a
row reused by another request), over two steps so the double-buffered host masks are each used; with the
matchers in the engine's process and in a grammar process of their own (structured/grammar_process.py)."""

import dataclasses
import functools
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.grammar_process import GrammarProcessError
from tokenmill.structured.matchers import GrammarRows, unpack_bitmask
from tokenmill.worker.request_state import RequestStates

xgr = pytest.importorskip("xgrammar")

TOKENIZER = Path(__file__).resolve().parents[2] / "benchmarks/models/smollm2-tokenizer"
SPECS = {0: StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"}},
                                          "required": ["name"], "additionalProperties": False}),
         1: StructuredOutputsParams(regex=r"(yes|no), because [a-z ]{3,30}\."),
         2: StructuredOutputsParams(choice=["Paris", "London"]),
         3: StructuredOutputsParams(grammar='root ::= "ok"'),
         5: StructuredOutputsParams(choice=["a", "b"])}


def new_compiler(tokenizer) -> GrammarCompiler:
    from transformers import AutoTokenizer

    # A recipe a grammar process can take (a partial, not a lambda).
    return GrammarCompiler(functools.partial(AutoTokenizer.from_pretrained, TOKENIZER), len(tokenizer), num_threads=1)


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    compiler = new_compiler(tokenizer)  # compiles here: the references' grammars, and the in-process rows'
    yield tokenizer, compiler
    compiler.shutdown()


def rows_compiler(setup, matchers: str) -> GrammarCompiler:
    """The compiler GrammarRows gets: a grammar process takes its compiler over (compiles its grammars), so a
    fresh one, which compiles nothing here."""
    tokenizer, compiler = setup
    return new_compiler(tokenizer) if matchers == "grammar process" else compiler


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def reference(compiler, tokenizer, spec, output: list[int], drafts: list[int], width: int) -> torch.Tensor:
    """[1 + drafts, width] allowed: a fresh matcher through the output, then walking the drafts."""
    matcher = xgr.GrammarMatcher(compiler.get(spec), override_stop_tokens=[tokenizer.eos_token_id])
    for token in output:
        matcher.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    everything = unpack_bitmask(torch.full_like(bitmask, -1), width)  # the tokenizer's whole vocabulary
    masks = []
    for position in range(len(drafts) + 1):
        if matcher.is_terminated():
            masks.append(everything)
        else:
            matcher.fill_next_token_bitmask(bitmask)
            masks.append(unpack_bitmask(bitmask, width))
        if position < len(drafts) and (matcher.is_terminated() or not matcher.accept_token(drafts[position])):
            masks += [everything] * (len(drafts) - position)
            break
    return torch.cat(masks)


def reference_guidance(compiled, tokenizer, output: list[int], drafts: list[int], width: int) -> torch.Tensor:
    """reference()'s masks from a plain llguidance matcher (its own EOS the tokenizer's: the request's stop token)."""
    import llguidance
    import llguidance.numpy

    matcher = llguidance.LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
    assert matcher.consume_tokens(output), matcher.get_error()
    ended = tokenizer.eos_token_id in output
    bitmask = llguidance.numpy.allocate_token_bitmask(1, len(tokenizer))
    everything = unpack_bitmask(torch.full((1, bitmask.shape[1]), -1, dtype=torch.int32), width)
    masks = []
    for position in range(len(drafts) + 1):
        if ended:
            masks.append(everything)
        else:
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
            masks.append(unpack_bitmask(torch.from_numpy(bitmask), width))
        if position < len(drafts):
            if ended or matcher.validate_tokens(drafts[position : position + 1]) != 1:
                masks += [everything] * (len(drafts) - position)
                break
            ended = drafts[position] == tokenizer.eos_token_id
            assert matcher.consume_token(drafts[position])
    return torch.cat(masks)


def two_fill_threads(monkeypatch) -> None:
    """Every batched fill split over two of xgrammar's threads (GrammarRows uses one below 64 rows)."""
    monkeypatch.setattr("tokenmill.structured.matcher_set.fill_threads", lambda num_rows: 2)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("matchers", ["in process", "threaded", "grammar process"])
@pytest.mark.parametrize("path", ["torch", pytest.param("kernel", marks=pytest.mark.interpret),
                                  pytest.param("cuda", marks=pytest.mark.gpu),
                                  pytest.param("cuda-bf16", marks=pytest.mark.gpu)])
def test_batched_masks_are_the_per_row_matchers(setup, path, matchers, backend, monkeypatch):
    """`kernel`: the Triton kernel's path (kernels/token_bitmask.py), under TRITON_INTERPRET=1 on the CPU;
    `cuda`: the GPU's (pinned host masks, their non-blocking copy on a stream of its own, the kernel); `cuda-bf16`
    with bfloat16 logits (the kernel for 16-bit logits). `threaded`: the fills on two
    of xgrammar's threads, as a large step's are; `grammar process`: the matchers in their own process, the
    masks through shared memory (pinned on the GPU). `guidance`: rows 0-2 under llguidance (each against a plain
    llguidance matcher), row 3 under xgrammar in the same batch."""
    tokenizer, compiler = setup
    specs = SPECS
    if backend == "guidance":
        if path != "torch" or matchers != "in process":
            # The fill and mask paths are the backends' alike; the grammar process runs llguidance's matchers in
            # tests/e2e/test_structured_outputs.py's speculative decoding test.
            pytest.skip("xgrammar's cases cover the other paths")
        pytest.importorskip("llguidance")
        specs = {row: dataclasses.replace(spec, backend="guidance") if row < 3 else spec
                 for row, spec in specs.items()}
    threaded = matchers == "threaded"
    if threaded:
        two_fill_threads(monkeypatch)
    device = torch.device("cpu")
    if path == "kernel":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the kernel's path on the CPU needs TRITON_INTERPRET=1")
        monkeypatch.setattr("tokenmill.structured.matchers.use_triton", lambda x: True)
    if path.startswith("cuda"):
        if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
            pytest.skip("needs a CUDA device")
        device = torch.device("cuda")
    eos = frozenset([tokenizer.eos_token_id])
    states = RequestStates(8, 64, 4)
    grammar_rows = GrammarRows(rows_compiler(setup, matchers), len(tokenizer), device,
                               in_process=matchers != "grammar process")
    started = '{"name": "' if backend == "xgrammar" else '{"name":"'  # llguidance's JSON: compact, as asked
    outputs = {0: encode(tokenizer, started), 1: encode(tokenizer, "yes"), 2: [], 3: encode(tokenizer, "ok"),
               4: [], 5: []}
    outputs[3].append(tokenizer.eos_token_id)  # terminated
    for row, output in outputs.items():
        prompt = [1, 2, 3]
        states.token_ids[row, : 3 + len(output)] = prompt + output
        states.num_prompt_tokens[row], states.num_tokens[row] = 3, 3 + len(output)
        states.sampling_params[row] = SamplingParams(structured_outputs=specs.get(row))
        if row in specs:
            grammar_rows.add(row, states, eos)
    states.row_generation[5] += 1  # row 5 now serves a request without a grammar
    width = len(tokenizer) + 64  # logits wider than the tokenizer's vocabulary

    def step(rows: list[int], drafts: dict[int, list[int]]) -> None:
        num_drafts = np.array([len(drafts.get(row, [])) for row in rows])
        for row in rows:  # drafts sit after the row's tokens
            states.token_ids[row, states.num_tokens[row] : states.num_tokens[row] + len(drafts.get(row, []))] = \
                drafts.get(row, [])
        rows_array = np.array(rows)
        constrained = grammar_rows.constrained(rows_array, states)
        assert [rows[i] for i in constrained] == [row for row in rows if row in specs and row != 5]
        counts = 1 + num_drafts
        logits = torch.randn(int(counts.sum()), width).to(torch.bfloat16 if path == "cuda-bf16" else torch.float32)
        expected = logits.clone()
        first = np.cumsum(counts) - counts
        for i in constrained:
            row = rows[i]
            if specs[row].backend == "guidance":
                allowed = reference_guidance(compiler.get(specs[row]), tokenizer, outputs[row], drafts.get(row, []),
                                             width)
            else:
                allowed = reference(compiler, tokenizer, specs[row], outputs[row], drafts.get(row, []), width)
            expected[first[i] : first[i] + counts[i]] = expected[first[i] : first[i] + counts[i]].masked_fill(
                ~allowed, float("-inf"))
        on_device = logits.to(device)
        grammar_rows.start(rows_array, first, num_drafts, states, constrained)
        grammar_rows.apply(on_device)
        assert torch.equal(on_device.cpu(), expected)

    # Step 1: several new tokens per row (a replay), drafts accepted (row 1) and refused (row 2's first).
    step([4, 0, 1, 2, 3, 5], {1: encode(tokenizer, ", because"), 2: encode(tokenizer, "Rome")[:1] + [5, 6]})
    # Step 2: one new token per row (the batched accept), no drafts.
    for row, text in ((0, "Al"), (1, ","), (2, "Par")):
        token = encode(tokenizer, text)[0]
        outputs[row].append(token)
        states.token_ids[row, states.num_tokens[row]] = token
        states.num_tokens[row] += 1
    step([0, 1, 2, 4], {})
    step([0, 2], {0: encode(tokenizer, 'ice"}')})  # back to the first host buffer; drafts up to the end
    step([0, 4, 1], {})  # logits rows 0 and 2: not consecutive
    if matchers == "grammar process":  # a grammar process that dies fails the next step, with a clear error
        assert grammar_rows.compiler.num_compiled == 0  # the grammar process compiled them
        os.kill(grammar_rows._matchers.pid, signal.SIGKILL)
        with pytest.raises(GrammarProcessError, match="exited"):
            step([0, 2], {})
    grammar_rows.close()


@pytest.mark.parametrize("path", ["torch", pytest.param("kernel", marks=pytest.mark.interpret)])
def test_a_padded_model_vocab_masks_as_xgrammar_compiled_at_the_model_vocab(setup, path, monkeypatch):
    """Logits wider than the tokenizer (padding ids; the model's own EOS past the tokenizer): grammars compile
    against the tokenizer's ids (structured/vocab.py) and GrammarRows forbids the rest, so the masks equal
    xgrammar's own compiled at the model's vocabulary (where the padding ids are special tokens), with the
    rows' fills on two of xgrammar's threads, for a replay and then one new token per row."""
    from tokenmill.structured.grammar import build_grammar

    tokenizer, _ = setup
    if path == "kernel":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the kernel's path on the CPU needs TRITON_INTERPRET=1")
        monkeypatch.setattr("tokenmill.structured.matchers.use_triton", lambda x: True)
    model_vocab = len(tokenizer) + 100
    width = model_vocab + 32  # and logits wider than the model's vocabulary
    compiler = GrammarCompiler(lambda: tokenizer, model_vocab, num_threads=1)
    two_fill_threads(monkeypatch)
    wide = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_vocab))
    eos = frozenset([tokenizer.eos_token_id, model_vocab - 1])
    states = RequestStates(8, 64, 4)
    grammar_rows = GrammarRows(compiler, model_vocab, torch.device("cpu"))
    outputs = {0: encode(tokenizer, '{"name": "'), 1: encode(tokenizer, "yes"), 2: [], 3: encode(tokenizer, "ok")}
    for row, output in outputs.items():
        states.token_ids[row, : 3 + len(output)] = [1, 2, 3] + output
        states.num_prompt_tokens[row], states.num_tokens[row] = 3, 3 + len(output)
        states.sampling_params[row] = SamplingParams(structured_outputs=SPECS[row])
        grammar_rows.add(row, states, eos)
    rows = np.array(list(outputs))
    assert grammar_rows.grammar_vocab_size is None  # the matchers are made at the rows' first sampling
    for step in range(2):
        if step == 1:
            for row, text in ((0, "Al"), (1, ","), (2, "Lon")):
                token = encode(tokenizer, text)[0]
                outputs[row].append(token)
                states.token_ids[row, states.num_tokens[row]] = token
                states.num_tokens[row] += 1
        constrained = grammar_rows.constrained(rows, states)
        assert grammar_rows.grammar_vocab_size == len(tokenizer)
        logits = torch.randn(len(rows), width)
        expected = logits.clone()
        for i, row in enumerate(rows.tolist()):
            matcher = xgr.GrammarMatcher(wide.compile_grammar(build_grammar(SPECS[row])),
                                         override_stop_tokens=[tokenizer.eos_token_id])
            assert all(matcher.accept_token(t) for t in outputs[row])
            bitmask = xgr.allocate_token_bitmask(1, model_vocab)
            matcher.fill_next_token_bitmask(bitmask)
            expected[i].masked_fill_(~unpack_bitmask(bitmask, width, model_vocab)[0], float("-inf"))
        grammar_rows.start(rows, np.arange(len(rows)), np.zeros(len(rows), dtype=np.int64), states, constrained)
        grammar_rows.apply(logits)
        assert torch.equal(logits, expected)
        assert not torch.isfinite(logits[:, len(tokenizer) :]).any()
    compiler.shutdown()


# A draft tree (speculative_token_tree) of depth 3: node i is TREE[i]'s path of child ranks.
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)]


@pytest.mark.parametrize("matchers", ["in process", "threaded", "grammar process"])
def test_tree_masks_are_a_fresh_matcher_along_each_nodes_path(setup, matchers, monkeypatch, caplog, capfd):
    """Draft trees: each node's logits row is masked as a fresh matcher through the row's output and then the
    node's path allows (all allowed where the grammar refuses a token on the path, or has ended before it);
    rows drafting the whole tree, its first nodes only, none, without a grammar, or terminated; then a step
    after one more token, which a matcher left off the known tokens would mask wrongly."""
    from tokenmill.spec.tree import TokenTree

    tokenizer, compiler = setup
    if matchers == "threaded":
        two_fill_threads(monkeypatch)
    tree = TokenTree.from_paths(tuple(TREE))
    eos = tokenizer.eos_token_id
    states = RequestStates(8, 64, 4)
    grammar_rows = GrammarRows(rows_compiler(setup, matchers), len(tokenizer), torch.device("cpu"),
                               in_process=matchers != "grammar process", tree=tree)
    outputs = {0: encode(tokenizer, '{"name": "'), 1: encode(tokenizer, "yes"), 2: [],
               3: encode(tokenizer, "ok") + [eos], 4: [], 5: []}
    for row, output in outputs.items():
        states.token_ids[row, : 3 + len(output)] = [1, 2, 3] + output
        states.num_prompt_tokens[row], states.num_tokens[row] = 3, 3 + len(output)
        states.sampling_params[row] = SamplingParams(structured_outputs=SPECS.get(row))
        if row in SPECS:
            grammar_rows.add(row, states, frozenset([eos]))
    width = len(tokenizer) + 64

    def node_tokens(texts: list) -> list[int]:
        return [t if isinstance(t, int) else encode(tokenizer, t)[0] for t in texts]

    seen = {"accepted at depth 3": 0, "all allowed": 0}  # nodes whose path the grammar takes, or does not

    def step(rows: list[int], drafts: dict[int, list[int]]) -> None:
        num_drafts = np.array([len(drafts.get(row, [])) for row in rows])
        for row in rows:
            states.token_ids[row, states.num_tokens[row] : states.num_tokens[row] + len(drafts.get(row, []))] = \
                drafts.get(row, [])
        rows_array = np.array(rows)
        constrained = grammar_rows.constrained(rows_array, states)
        counts = 1 + num_drafts
        first = np.cumsum(counts) - counts
        logits = torch.randn(int(counts.sum()), width)
        expected = logits.clone()
        for i in constrained:
            row = rows[i]
            nodes = drafts.get(row, [])
            allowed = [reference(compiler, tokenizer, SPECS[row], outputs[row], [], width)]
            for node in range(len(nodes)):
                path = [node]
                while tree.parent[path[0]] >= 0:
                    path.insert(0, int(tree.parent[path[0]]))
                along = reference(compiler, tokenizer, SPECS[row], outputs[row], [nodes[j] for j in path], width)
                allowed.append(along[-1:])
                if row != 3:  # (a terminated row's nodes are all refused)
                    everything = bool(along[-1, : len(tokenizer)].all())
                    seen["all allowed"] += everything
                    seen["accepted at depth 3"] += len(path) == 3 and not everything
            expected[first[i] : first[i] + counts[i]].masked_fill_(~torch.cat(allowed), float("-inf"))
        grammar_rows.start(rows_array, first, num_drafts, states, constrained)
        grammar_rows.apply(logits)
        assert torch.equal(logits, expected)

    # Node order: (0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0).
    step([4, 0, 1, 2, 3, 5], {
        0: node_tokens(["Al", '"', "ice", "{", "}", '"}', "x", eos]),  # a branch that ends the grammar
        1: node_tokens([",", ".", " because", "!", " no", " the", " a", "."]),  # "." and "!" refused: subtrees
        2: node_tokens(["Par", "Lon", "is", "Rome", "don"]),  # the tree's first 5 nodes only
        3: node_tokens([",", "a", "b"]),  # terminated
        4: node_tokens(["a", "b"]),  # no grammar
    })
    assert seen["accepted at depth 3"] >= 3 and seen["all allowed"] >= 4, seen
    # One token each, but row 2: a verified path through its stop token and past it (the stop token's mask
    # allows all), which its matcher must not be handed (the request ends at the stop token).
    for row, texts in ((0, ["Al"]), (1, [","]), (2, ["London", eos, "x"])):
        tokens = node_tokens(texts)
        outputs[row] += tokens
        states.token_ids[row, states.num_tokens[row] : states.num_tokens[row] + len(tokens)] = tokens
        states.num_tokens[row] += len(tokens)
    step([0, 1, 2, 5], {0: node_tokens(["ice", "an", '"', '",', "}", "}", " ", eos]), 1: node_tokens([" because"]),
                        5: node_tokens(["a", "b", "a"])})
    step([0, 1, 2], {})  # every matcher back at its known tokens
    if matchers == "grammar process":
        assert grammar_rows.compiler.num_compiled == 0  # the grammar process compiled them
    grammar_rows.close()
    assert "refused" not in caplog.text + capfd.readouterr().err  # (a grammar process logs to its stderr)


def test_a_grammar_process_compiles_for_the_engine_core(setup, monkeypatch):
    """With the matchers in a grammar process, it compiles each spec once and the engine core's requests wait
    for its report: nothing compiles in the engine's process, a spec it cannot compile fails only its request
    (the process serves on), and its death fails the compiles pending then and later instead of hanging."""
    from tokenmill.request import Request
    from tokenmill.structured.waiting import AwaitingGrammar

    tokenizer, reference_compiler = setup
    compiler = new_compiler(tokenizer)
    grammar_rows = GrammarRows(compiler, len(tokenizer), torch.device("cpu"), in_process=False)
    awaiting = AwaitingGrammar(compiler)
    bad = StructuredOutputsParams(regex="(abc")  # the frontend would refuse it: a compile that fails
    for request_id, spec in (("good", SPECS[1]), ("bad", bad), ("same", SPECS[1])):
        awaiting.add(Request(request_id, [1, 2, 3], SamplingParams(structured_outputs=spec)))
    assert compiler.submit(SPECS[1]) is compiler.submit(SPECS[1])
    ready, failed = [], {}
    for _ in range(400):  # 20 s at most
        now_ready, now_failed = awaiting.take_ready(idle=True)
        ready += [request.request_id for request in now_ready]
        failed.update(now_failed)
        if not awaiting:
            break
    assert sorted(ready) == ["good", "same"] and list(failed) == ["bad"] and "invalid regex" in str(failed["bad"])
    assert "invalid regex" in str(compiler.submit(bad).exception())
    assert compiler.num_compiled == 0 and compiler.grammar_vocab_size == len(tokenizer)
    with pytest.raises(RuntimeError, match="grammar process"):
        compiler.get(SPECS[1])

    # The process serves on: a row under the spec that compiled masks as a plain matcher.
    states = RequestStates(4, 64, 4)
    output = encode(tokenizer, "yes")
    states.token_ids[0, : 3 + len(output)] = [1, 2, 3] + output
    states.num_prompt_tokens[0], states.num_tokens[0] = 3, 3 + len(output)
    states.sampling_params[0] = SamplingParams(structured_outputs=SPECS[1])
    grammar_rows.add(0, states, frozenset([tokenizer.eos_token_id]))
    rows = np.array([0])
    constrained = grammar_rows.constrained(rows, states)  # its first sampling: the matcher is made
    assert grammar_rows.grammar_vocab_size == len(tokenizer)
    logits = torch.randn(1, len(tokenizer))
    expected = logits.masked_fill(~reference(reference_compiler, tokenizer, SPECS[1], output, [], len(tokenizer)),
                                  float("-inf"))
    grammar_rows.start(rows, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), states, constrained)
    grammar_rows.apply(logits)
    assert torch.equal(logits, expected)

    # Stopped, it holds compiles pending: one the cache forgot (MAX_CACHED) is still the one future, and all
    # complete when it goes on. Killed, its pending compiles fail, and so does any later one.
    pid = grammar_rows._matchers.pid
    os.kill(pid, signal.SIGSTOP)
    monkeypatch.setattr("tokenmill.structured.compiler.MAX_CACHED", 1)
    first = compiler.submit(SPECS[2])
    second = compiler.submit(SPECS[3])  # SPECS[2] forgotten by the cache
    assert compiler.submit(SPECS[2]) is first and not first.done() and not second.done()
    os.kill(pid, signal.SIGCONT)
    assert first.result(timeout=10) is None and second.result(timeout=10) is None
    os.kill(pid, signal.SIGSTOP)
    pending = compiler.submit(SPECS[0])
    assert not pending.done()
    os.kill(pid, signal.SIGKILL)
    assert isinstance(pending.exception(timeout=10), GrammarProcessError)
    assert isinstance(compiler.submit(SPECS[2]).exception(timeout=0), GrammarProcessError)
    grammar_rows.close()
    compiler.shutdown()
