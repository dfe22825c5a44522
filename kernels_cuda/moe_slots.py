"""The expert-slot scan that opens the weight-streaming MoE's up kernels (``moe_gemv``'s ``moe_up`` and
``moe_up_mma``, ``moe_gemv_fp8``'s ``moe_up_fp8``), as a TileLang macro: grid column ``s`` is routing slot s, and
its CTA does expert e = ids[s]'s work for every slot of e unless an earlier slot holds e too."""


def expert_slots_macro(T):
    """A macro run by every thread of the CTA of slot ``s`` (expert ``e`` = Ids[s] as int32, ``NS`` slots, at most
    one per thread: thread ``lin`` checks slot ``lin``): lists the slots of e into the shared ``rows`` (in the
    order the shared counter ``cnt`` gives them), ``nr[0]`` = their count, and ``mine[0]`` = 1 unless a slot before
    s holds e (that slot's CTA does e's work; through the shared flag ``first``). Two CTA barriers. ``s``, ``e`` and
    ``lin`` are variables (a macro binds an expression argument to a new variable, which changes what the
    kernel's simplification sees)."""

    @T.macro
    def expert_slots(Ids, NS, s, e, lin, rows, cnt, first, nr, mine):
        if lin == 0:
            cnt[0] = 0
            first[0] = 1
        T.sync_threads()
        if lin < NS:
            if T.cast(Ids[lin], "int32") == e:
                if lin < s:
                    first[0] = 0  # an earlier slot's CTA owns this expert
                else:
                    pos = T.atomic_add(cnt[0], 1, return_prev=True)
                    rows[pos] = lin
        T.sync_threads()
        nr[0] = cnt[0]
        mine[0] = first[0]

    return expert_slots
