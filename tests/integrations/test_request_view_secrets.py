"""A request's cache salt reaches its keys and its tenant, never a printed request."""

from tiered_kv.integrations.common import RequestView


def test_a_request_views_repr_names_neither_its_salted_key_parts_nor_its_tenant():
    view = RequestView(request_id="r1", prompt_token_ids=[1, 2, 3], num_prompt_tokens=3,
                       key_extra="salt=hunter2;lora=7", tenant="hunter2")
    shown = repr(view)
    assert "hunter2" not in shown and "r1" in shown
    assert view.tenant == "hunter2" and view.key_extra.startswith("salt=")
