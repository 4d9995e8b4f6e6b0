"""Found by the soak's fuzz (scripts/soak.py): an HTTP request with `"top_k": 10**30` passed
validation, and the daemon could then not encode its StepPlan; the scheduler took that for a
broken worker link and restarted the worker, failing every request in flight. Every value a
front end accepts must fit the wire: the bound lives in SamplingParams, for both APIs."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.codec import decode, encode
from protocol.messages import MAX_SEED, SamplingParams, SlotWork, StepPlan, WorkKind
from protocol.sampling import MAX_TOP_K
from tests.unit import api_test_client
from tests.unit.api_test_client import CHAT, _error

client, tokenizer = api_test_client.client, api_test_client.tokenizer


@pytest.mark.parametrize("top_k", [MAX_TOP_K + 1, 2**64 - 1, 10**30])
def test_top_k_past_the_bound_is_refused(top_k):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=top_k)


def test_the_largest_accepted_values_fit_a_step_plan():
    sampling = SamplingParams(temperature=1e308, top_k=MAX_TOP_K, seed=MAX_SEED)
    work = SlotWork(slot=0, request_id="r", kind=WorkKind.DECODE, start_pos=3, num_tokens=1,
                    input_ids=np.array([1], np.int32), needs_logits=True, prompt_len=3,
                    sampling=sampling)
    plan = decode(encode(StepPlan(step_id=1, slots=[work])))
    assert plan.slots[0].sampling == sampling


@pytest.mark.parametrize("top_k", [MAX_TOP_K + 1, 10**30])
async def test_http_refuses_a_huge_top_k(client, top_k):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_k": top_k}
    err = await _error(await client.post(CHAT, json=body), 400)
    assert "top_k must be in" in err["message"]
