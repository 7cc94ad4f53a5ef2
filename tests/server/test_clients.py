"""Real clients against the real server on the default model: lm-eval's ``local-completions``
loglikelihood requests and langchain-openai's ``bind_tools`` / ``with_structured_output``.

No hub access: lm-eval gets the engine's own tokenizer saved as a local Hugging Face directory,
and the Instances are built here instead of from a task.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_tokenizer_dir(real_engine_server, tmp_path_factory):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    _, engine, *_ = real_engine_server
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(engine.tokenizer_json()))
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return path


def reference_loglikelihood(engine, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """Sum of log p(continuation | context) and whether it is the greedy continuation, from one
    forward pass of the model on a fresh cache."""
    ids = ctx + cont
    cache = engine.model.new_cache(1, engine.n_ctx)
    with torch.inference_mode():
        logp = torch.log_softmax(engine.model(torch.tensor([ids]), 0, cache)[0].float(), -1)
    rows = logp[len(ctx) - 1 : len(ids) - 1]
    target = torch.tensor(cont)
    total = float(rows[torch.arange(len(cont)), target].sum())
    return total, bool((rows.argmax(-1) == target).all())


def test_lm_eval_loglikelihood(real_engine_server, hf_tokenizer_dir):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    srv, engine, *_ = real_engine_server
    lm = LocalCompletionsAPI(
        base_url=srv.base_url + "/completions",
        model=engine.name,
        tokenizer_backend="huggingface",
        tokenizer=str(hf_tokenizer_dir),
        batch_size=2,  # two prompts per request: the server's prompt lists
        max_retries=1,
        num_concurrent=1,
    )
    pairs = [
        ("The capital of France is", " Paris"),
        ("The capital of France is", " a banana"),
        ("One, two, three,", " four"),
    ]
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(pairs)
    ]
    results = lm.loglikelihood(requests)
    tok = AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    assert len(results) == len(pairs), lm_eval.__version__
    for (ctx, cont), (ll, greedy) in zip(pairs, results):
        ref, ref_greedy = reference_loglikelihood(
            engine, tok.encode(ctx, add_special_tokens=False),
            tok.encode(cont, add_special_tokens=False))
        assert ll == pytest.approx(ref, abs=1e-2)
        assert greedy == ref_greedy
    assert results[0][0] > results[1][0]  # Paris beats a banana


def test_langchain_tools_and_structured_output(real_engine_server):
    pytest.importorskip("langchain_openai")
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    srv, engine, *_ = real_engine_server

    class GetWeather(BaseModel):
        """Current weather in a city."""

        city: Literal["Paris", "London"] = Field(description="the city")

    class Capital(BaseModel):
        city: Literal["Paris", "London", "Rome"]
        country: Literal["France", "England", "Italy"]

    llm = ChatOpenAI(model=engine.name, base_url=srv.base_url, api_key="none", temperature=0,
                     max_tokens=40, max_retries=0, timeout=60)
    for choice in ("GetWeather", "any"):
        msg = llm.bind_tools([GetWeather], tool_choice=choice).invoke(
            "What is the weather in Paris?")
        assert len(msg.tool_calls) == 1, (msg, msg.response_metadata)
        [call] = msg.tool_calls
        assert call["name"] == "GetWeather" and call["args"]["city"] in ("Paris", "London")
    answer = llm.with_structured_output(Capital).invoke("What is the capital of France?")
    assert isinstance(answer, Capital)
    answer = llm.with_structured_output(Capital, method="function_calling").invoke(
        "What is the capital of France?")
    assert isinstance(answer, Capital)
    # json_mode is response_format json_object: any JSON object (no schema to hold it to)
    answer = llm.with_structured_output(Capital.model_json_schema(), method="json_mode").invoke(
        "What is the capital of France? Answer in JSON with keys city and country.")
    assert isinstance(answer, dict)
