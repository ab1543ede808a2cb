"""`--workload multi-tenant`: tenants' shared system prompts, turns that repeat the turns before."""

from shoal.runtime.bench import workloads


def test_turns_extend_the_previous_turns_behind_the_tenants_system_prompt():
    items = workloads.multi_tenant(tenants=3, conversations=2, turns=3, system_len=40, turn_len=(5, 9), answer_len=4, seed=7)
    assert len(items) == 3 * 2 * 3 and all(it.output_len == 4 for it in items)
    first, later = items[:6], items[6:]
    systems = {tuple(it.prompt[:40]) for it in first}
    assert len(systems) == 3  # one per tenant, each shared by its two conversations
    for it in later:  # every later turn starts with some earlier turn of its conversation, plus its answer
        parents = [p for p in items if len(p.prompt) < len(it.prompt) and it.prompt[: len(p.prompt)] == p.prompt]
        assert parents, "a turn that does not repeat its conversation"
        longest = max(parents, key=lambda p: len(p.prompt))
        assert 4 + 5 <= len(it.prompt) - len(longest.prompt) <= 4 + 9  # the answer, then a new user message


def test_a_salt_keeps_the_shapes_and_changes_every_token():
    a = workloads.multi_tenant(tenants=2, turns=2, seed=1, salt=1)
    b = workloads.multi_tenant(tenants=2, turns=2, seed=1, salt=2)
    assert [len(x.prompt) for x in a] == [len(x.prompt) for x in b]
    assert not {tuple(x.prompt[:16]) for x in a} & {tuple(x.prompt[:16]) for x in b}
    assert [x.prompt for x in a] == [x.prompt for x in workloads.multi_tenant(tenants=2, turns=2, seed=1, salt=1)]
