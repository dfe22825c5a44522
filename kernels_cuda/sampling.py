"""Fused sampling (TileLang): ``sample`` (temperature, top-k, top-p, min-p and a seeded exponential race,
one CTA per row, no sort) and ``greedy_sample`` (greedy decoding's draw, its logprob and the normaliser in one
launch over the vocabulary's chunks: ``build_greedy``).

The reference keeps a prefix of the descending order: rank r survives when r < k, the mass ranked
before it is < top_p, and its probability is >= min_p * p_max. Those conditions only depend on the
counts and masses *strictly above* a value, so the survivors are {i : key(l_i) >= tau} for one
threshold tau on the order-preserving uint32 key of the float logit. tau is found by a 16-way search
over the key range: every pass over the row evaluates 15 candidate thresholds at once (count and
mass above each), so 8 passes pin down 32 bits. Rows with neither top-k nor top-p skip the search.

The draw is argmax_i p_i / E_i with E_i = -log(u_i) and u_i from the counter RNG of
``kernels_cpu.rng`` (same 32-bit hash, same (seed, offset, column) -> uniform map, bit for bit), so a
row samples the same token on any backend and in any batch. Dividing every p_i by the same kept-set
normaliser does not move the argmax, so the kernel races exp(l_i - max) directly.
"""

import torch

from kernels_cuda import _tl

NTHR = 1024
NPROBE = 15
SEARCH_PASSES = 9  # 16-way steps over a 2**32 key range (8 suffice; one spare)


def build_sample():
    T = _tl.language()
    B, V = T.dynamic("B"), T.dynamic("V")
    NW = NTHR // 32
    f32, i32, u32 = "float32", "int32", "uint32"
    ninf = -T.infinity(f32)

    def key_of(v):
        bits = T.reinterpret(v, u32)
        return T.if_then_else(bits >= T.uint32(0x80000000), ~bits, bits | T.uint32(0x80000000))

    @T.prim_func
    def sample_kernel(Logits: T.Tensor((B, V), f32), Temp: T.Tensor((B,), f32), TopK: T.Tensor((B,), "int64"),
                      TopP: T.Tensor((B,), f32), MinP: T.Tensor((B,), f32), Seeds: T.Tensor((B,), "int64"),
                      Offs: T.Tensor((B,), "int64"), Out: T.Tensor((B,), "int64")):
        with T.Kernel(B, threads=NTHR) as row:
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            red_v = T.alloc_shared((NW,), f32)
            red_i = T.alloc_shared((NW,), i32)
            pc = T.alloc_shared((NW, NPROBE + 1), i32)
            pm = T.alloc_shared((NW, NPROBE + 1), f32)
            bounds = T.alloc_shared((2,), u32)
            cnt = T.alloc_local((NPROBE + 1,), i32)  # [NPROBE]: keys >= hi (above every probe)
            mass = T.alloc_local((NPROBE + 1,), f32)
            probe = T.alloc_local((NPROBE,), u32)
            bv = T.alloc_var(f32, ninf)
            bi = T.alloc_var(i32, 0)
            ov = T.alloc_var(f32, 0.0)
            oi = T.alloc_var(i32, 0)
            acc = T.alloc_var(f32, 0.0)
            ev = T.alloc_var(f32, 0.0)

            temp = Temp[row]
            greedy = temp <= 0
            tt = T.if_then_else(greedy, T.float32(1.0), temp)
            # ---- pass 1: max and first argmax of l = logits / t
            bi = V
            for it in T.serial(T.ceildiv(V, NTHR)):
                i = it * NTHR + tx
                if i < V:
                    v = Logits[row, i] / tt
                    if v > bv:
                        bv = v
                        bi = i
            for s in T.unroll(5):
                ov = T.shfl_xor(bv, 16 >> s)
                oi = T.shfl_xor(bi, 16 >> s)
                if (ov > bv) | ((ov == bv) & (oi < bi)):
                    bv = ov
                    bi = oi
            if lane == 0:
                red_v[warp] = bv
                red_i[warp] = bi
            T.sync_threads()
            bv = ninf
            bi = V
            for w in T.serial(NW):
                if (red_v[w] > bv) | ((red_v[w] == bv) & (red_i[w] < bi)):
                    bv = red_v[w]
                    bi = red_i[w]
            m = T.alloc_var(f32, bv)
            if greedy:
                if tx == 0:
                    Out[row] = T.cast(bi, "int64")
            else:
                T.sync_threads()
                # ---- pass 2: softmax normaliser
                acc = 0.0
                for it in T.serial(T.ceildiv(V, NTHR)):
                    i = it * NTHR + tx
                    if i < V:
                        acc += T.exp(Logits[row, i] / tt - m)
                for s in T.unroll(5):
                    acc += T.shfl_xor(acc, 16 >> s)
                if lane == 0:
                    red_v[warp] = acc
                T.sync_threads()
                z = T.alloc_var(f32, 0.0)
                for w in T.serial(NW):
                    z += red_v[w]
                inv_z = T.alloc_var(f32, 1.0 / z)
                k_raw = TopK[row]
                k = T.if_then_else((k_raw <= 0) | (k_raw > T.cast(V, "int64")), V, T.cast(k_raw, i32))
                top_p = TopP[row]
                min_p = MinP[row]
                # ---- threshold search: kept <=> key >= lo at the end
                lo = T.alloc_var(u32, T.uint32(0))
                hi = T.alloc_var(u32, key_of(m) + T.uint32(1))
                if (k < V) | (top_p < 1.0):
                    for _ in T.serial(SEARCH_PASSES):
                        if hi - lo > T.uint32(1):
                            span = hi - lo
                            for j in T.unroll(NPROBE):
                                # lo + span * (j + 1) / 16 without 32-bit overflow
                                probe[j] = lo + (span // T.uint32(16)) * T.uint32(j + 1) + \
                                    (span % T.uint32(16)) * T.uint32(j + 1) // T.uint32(16)
                            for j in T.unroll(NPROBE + 1):
                                cnt[j] = 0
                                mass[j] = 0.0
                            for it in T.serial(T.ceildiv(V, NTHR)):
                                i = it * NTHR + tx
                                if i < V:
                                    v = Logits[row, i] / tt
                                    kv = key_of(v)
                                    if kv >= lo:  # keys below lo are below every probe: no exp needed
                                        ev = T.exp(v - m) * inv_z
                                        if kv >= hi:
                                            cnt[NPROBE] += 1
                                            mass[NPROBE] += ev
                                        else:
                                            for j in T.unroll(NPROBE):
                                                if kv >= probe[j]:
                                                    cnt[j] += 1
                                                    mass[j] += ev
                            for j in T.unroll(NPROBE + 1):
                                for s in T.unroll(5):
                                    cnt[j] += T.shfl_xor(cnt[j], 16 >> s)
                                    mass[j] += T.shfl_xor(mass[j], 16 >> s)
                                if lane == 0:
                                    pc[warp, j] = cnt[j]
                                    pm[warp, j] = mass[j]
                            T.sync_threads()
                            if tx == 0:
                                nlo = T.alloc_var(u32, lo)
                                nhi = T.alloc_var(u32, hi)
                                for j in T.serial(NPROBE):
                                    c_tot = T.alloc_var(i32, 0)
                                    m_tot = T.alloc_var(f32, 0.0)
                                    for w in T.serial(NW):
                                        c_tot += pc[w, j] + pc[w, NPROBE]
                                        m_tot += pm[w, j] + pm[w, NPROBE]
                                    ok = (c_tot < k) & (m_tot < top_p)
                                    if ok:
                                        if probe[j] < nhi:
                                            nhi = probe[j]
                                    else:
                                        if probe[j] > nlo:
                                            nlo = probe[j]
                                bounds[0] = nlo
                                bounds[1] = nhi
                            T.sync_threads()
                            lo = bounds[0]
                            hi = bounds[1]
                            T.sync_threads()
                    # h(lo) false, h(hi) true, hi == lo + 1: survivors have key >= lo
                else:
                    lo = T.uint32(0)
                # ---- final pass: the race among survivors
                seed = Seeds[row]
                rkey = T.alloc_var(u32, T.cast(seed & T.int64(0xFFFFFFFF), u32) ^ T.uint32(0x9E3779B9))
                rkey = rkey ^ (rkey >> T.uint32(16))  # lowbias32, written out: see kernels_cpu.rng
                rkey = rkey * T.uint32(0x7FEB352D)
                rkey = rkey ^ (rkey >> T.uint32(15))
                rkey = rkey * T.uint32(0x846CA68B)
                rkey = rkey ^ (rkey >> T.uint32(16))
                rkey = rkey ^ T.cast((seed >> T.int64(32)) & T.int64(0xFFFFFFFF), u32)
                rkey = rkey ^ (rkey >> T.uint32(16))  # lowbias32, written out: see kernels_cpu.rng
                rkey = rkey * T.uint32(0x7FEB352D)
                rkey = rkey ^ (rkey >> T.uint32(15))
                rkey = rkey * T.uint32(0x846CA68B)
                rkey = rkey ^ (rkey >> T.uint32(16))
                rkey = rkey ^ T.cast(Offs[row] & T.int64(0xFFFFFFFF), u32)
                rkey = rkey ^ (rkey >> T.uint32(16))  # lowbias32, written out: see kernels_cpu.rng
                rkey = rkey * T.uint32(0x7FEB352D)
                rkey = rkey ^ (rkey >> T.uint32(15))
                rkey = rkey * T.uint32(0x846CA68B)
                rkey = rkey ^ (rkey >> T.uint32(16))
                h = T.alloc_var(u32, T.uint32(0))
                minp_cut = min_p * inv_z
                bv = -1.0
                bi = V
                for it in T.serial(T.ceildiv(V, NTHR)):
                    i = it * NTHR + tx
                    if i < V:
                        v = Logits[row, i] / tt
                        ev = T.exp(v - m)
                        if (key_of(v) >= lo) & (ev * inv_z >= minp_cut):
                            h = rkey ^ T.cast(i, u32)
                            h = h ^ (h >> T.uint32(16))  # lowbias32, written out: see kernels_cpu.rng
                            h = h * T.uint32(0x7FEB352D)
                            h = h ^ (h >> T.uint32(15))
                            h = h * T.uint32(0x846CA68B)
                            h = h ^ (h >> T.uint32(16))
                            h = h + T.uint32(0x632BE5AB)
                            h = h ^ (h >> T.uint32(16))  # lowbias32, written out: see kernels_cpu.rng
                            h = h * T.uint32(0x7FEB352D)
                            h = h ^ (h >> T.uint32(15))
                            h = h * T.uint32(0x846CA68B)
                            h = h ^ (h >> T.uint32(16))
                            u = (T.cast(h >> T.uint32(8), f32) + 0.5) * T.float32(1.0 / (1 << 24))
                            race = ev / (-T.log(u))
                            if race > bv:
                                bv = race
                                bi = i
                for s in T.unroll(5):
                    ov = T.shfl_xor(bv, 16 >> s)
                    oi = T.shfl_xor(bi, 16 >> s)
                    if (ov > bv) | ((ov == bv) & (oi < bi)):
                        bv = ov
                        bi = oi
                if lane == 0:
                    red_v[warp] = bv
                    red_i[warp] = bi
                T.sync_threads()
                if tx == 0:
                    fv = T.alloc_var(f32, -1.0)
                    fi = T.alloc_var(i32, V)
                    for w in T.serial(NW):
                        if (red_v[w] > fv) | ((red_v[w] == fv) & (red_i[w] < fi)):
                            fv = red_v[w]
                            fi = red_i[w]
                    Out[row] = T.cast(fi, "int64")

    return sample_kernel


_kernel = _tl.kernel_cache(build_sample)

# ---- greedy_sample: argmax, log-sum-exp and the chosen logprob in one launch ------------------------------------
GREEDY_THREADS = 256
GREEDY_PER_THREAD = 8
GREEDY_CHUNK = GREEDY_THREADS * GREEDY_PER_THREAD  # logits per CTA: 50 CTAs a row at V2/V3's vocabularies
MAX_GREEDY_ROWS = 4096  # rows of one launch (its counters); more: the reference's torch reductions


def build_greedy(pdl: bool = False):
    """``greedy_sample``. Grid (NC, R), NC = ceil(V / GREEDY_CHUNK): a CTA reduces its chunk of a row to the
    chunk's (max, first index of the max, sum of exp(x - max)) in one read of its logits, writes them to the
    partials and counts the finished chunks on the row's device-scope counter (acq_rel, as ``moe_gate``). The
    CTA that brings the count to NC merges the row's NC partials (acquire loads), writes the token, the
    normaliser and the logprob, and puts the counter back to 0. ``pdl``: it waits for the kernel before it (the
    logits' GEMV) first; it has no loads of its own to issue earlier.

    Non-finite logits follow the reference (``torch.argmax``, ``torch.logsumexp``): a NaN is the maximum (the
    first NaN the token, the normaliser NaN); a chunk's exp sum is taken against 0 where its max is not finite
    (all -inf: the sum is 0; +inf: the sum is inf), and a chunk of sum 0 adds nothing to the row's."""
    T = _tl.language()
    gate = _tl.pdl_gate() if pdl else None
    R, V, NC = T.dynamic("R"), T.dynamic("V"), T.dynamic("NC")
    TH, PT, CH = GREEDY_THREADS, GREEDY_PER_THREAD, GREEDY_CHUNK
    NW = TH // 32
    f32, i32 = "float32", "int32"
    ninf, pinf = -T.infinity(f32), T.infinity(f32)

    def beats(v, i, bv, bi):
        """(v, i) comes before (bv, bi) in torch.argmax's order: NaN above everything, then larger values;
        ties to the lower index."""
        vn, bn = T.isnan(v), T.isnan(bv)
        return (vn & (T.Not(bn) | (i < bi))) | (T.Not(vn) & T.Not(bn) & ((v > bv) | ((v == bv) & (i < bi))))

    def shift(m):
        """The exponent shift of a max: itself where finite, else 0 (as torch.logsumexp)."""
        return T.if_then_else((m > ninf) & (m < pinf), m, T.float32(0.0))

    @T.macro
    def block_argmax(best_v, best_i, red_v, red_i, lane, warp):
        """Every thread's (best_v[0], best_i[0]) -> the block's, in every thread."""
        for sft in T.unroll(5):
            ov = T.shfl_xor(best_v[0], 16 >> sft)
            oi = T.shfl_xor(best_i[0], 16 >> sft)
            if beats(ov, oi, best_v[0], best_i[0]):
                best_v[0] = ov
                best_i[0] = oi
        if lane == 0:
            red_v[warp] = best_v[0]
            red_i[warp] = best_i[0]
        T.sync_threads()
        for w in T.serial(NW):
            if beats(red_v[w], red_i[w], best_v[0], best_i[0]):
                best_v[0] = red_v[w]
                best_i[0] = red_i[w]

    @T.macro
    def block_sum(acc, red_s, lane, warp, tx):
        """Every thread's acc[0] -> the block's, in thread 0."""
        for sft in T.unroll(5):
            acc[0] += T.shfl_xor(acc[0], 16 >> sft)
        if lane == 0:
            red_s[warp] = acc[0]
        T.sync_threads()
        if tx == 0:
            for w in T.serial(NW - 1):
                acc[0] += red_s[w + 1]

    @T.prim_func
    def greedy_kernel(X: T.Tensor((R, V), f32), Tok: T.Tensor((R,), "int64"), Lp: T.Tensor((R,), f32),
                      Lse: T.Tensor((R,), f32), PartMS: T.Tensor((2, R, NC), f32), PartI: T.Tensor((R, NC), i32),
                      Count: T.Tensor((MAX_GREEDY_ROWS,), i32)):
        with T.Kernel(NC, R, threads=TH) as (c, r):
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            xv = T.alloc_local((PT,), f32)
            best_v = T.alloc_local((1,), f32)
            best_i = T.alloc_local((1,), i32)
            acc = T.alloc_local((1,), f32)
            red_v = T.alloc_shared((NW,), f32)
            red_i = T.alloc_shared((NW,), i32)
            red_s = T.alloc_shared((NW,), f32)
            last = T.alloc_shared((1,), i32)
            if pdl:
                gate()
            # ---- the chunk: one read of its logits, then (max, first argmax) and the exp sum from registers
            for k in T.unroll(PT):
                if c * CH + k * TH + tx < V:
                    xv[k] = X[r, c * CH + k * TH + tx]
                else:
                    xv[k] = ninf
            best_v[0] = ninf
            best_i[0] = V  # no index yet: any logit of the row beats it (a -inf one by its lower index)
            for k in T.unroll(PT):
                if c * CH + k * TH + tx < V:
                    if beats(xv[k], c * CH + k * TH + tx, best_v[0], best_i[0]):
                        best_v[0] = xv[k]
                        best_i[0] = c * CH + k * TH + tx
            block_argmax(best_v, best_i, red_v, red_i, lane, warp)
            acc[0] = 0.0
            for k in T.unroll(PT):
                acc[0] += T.exp(xv[k] - shift(best_v[0]))
            block_sum(acc, red_s, lane, warp, tx)
            if tx == 0:
                PartMS[0, r, c] = best_v[0]
                PartMS[1, r, c] = acc[0]
                PartI[r, c] = best_i[0]
                last[0] = T.atomic_add(Count[r], 1, memory_order="acq_rel", return_prev=True)
            T.sync_threads()
            if last[0] == NC - 1:  # every chunk of row r is in: this CTA merges them
                best_v[0] = ninf
                best_i[0] = V
                for j in T.serial(T.ceildiv(NC, TH)):
                    if j * TH + tx < NC:
                        pm = T.atomic_load(PartMS[0, r, j * TH + tx], "acquire")
                        pi = T.atomic_load(PartI[r, j * TH + tx], "acquire")
                        if beats(pm, pi, best_v[0], best_i[0]):
                            best_v[0] = pm
                            best_i[0] = pi
                T.sync_threads()  # every thread has read the chunk's red_v / red_i: the merge reuses them
                block_argmax(best_v, best_i, red_v, red_i, lane, warp)
                acc[0] = 0.0
                for j in T.serial(T.ceildiv(NC, TH)):
                    if j * TH + tx < NC:
                        ps = T.atomic_load(PartMS[1, r, j * TH + tx], "acquire")
                        pm = T.atomic_load(PartMS[0, r, j * TH + tx], "acquire")
                        if ps != 0:  # a chunk of sum 0 (all -inf) adds nothing; a NaN sum propagates
                            acc[0] += ps * T.exp(shift(pm) - shift(best_v[0]))
                T.sync_threads()  # thread 0 has read the chunk's red_s: the merge reuses it
                block_sum(acc, red_s, lane, warp, tx)
                if tx == 0:
                    Tok[r] = T.cast(best_i[0], "int64")
                    Lse[r] = shift(best_v[0]) + T.log(acc[0])
                    Lp[r] = X[r, best_i[0]] - (shift(best_v[0]) + T.log(acc[0]))
                    Count[r] = 0

    return greedy_kernel


_greedy = _tl.kernel_cache(build_greedy)


def greedy_sample(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registry's ``greedy_sample``: one launch (``build_greedy``) for float32 rows on a CUDA device, at most
    ``MAX_GREEDY_ROWS`` of them; the reference otherwise (and while a graph capture runs before the counters
    exist)."""
    from kernels_cpu import ops as ref

    R, V = x.shape
    fits = x.dtype == torch.float32 and 1 <= R <= MAX_GREEDY_ROWS and V >= 1 and (x.is_cuda or _tl.dry_run())
    count = _tl.launch_counters("greedy_sample", MAX_GREEDY_ROWS, x.device) if fits else None
    if count is None:
        return ref.greedy_sample(x)
    x = x.contiguous()
    NC = -(-V // GREEDY_CHUNK)
    dev = x.device
    tok = torch.empty(R, dtype=torch.int64, device=dev)
    lp, lse = torch.empty(R, device=dev), torch.empty(R, device=dev)
    part_ms = torch.empty(2, R, NC, device=dev)
    part_i = torch.empty(R, NC, dtype=torch.int32, device=dev)
    _greedy(*_tl.pdl_arg(R))(x, tok, lp, lse, part_ms, part_i, count)
    return tok, lp, lse


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    B, V = logits.shape
    dev = logits.device
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out
    _kernel()(logits.float().contiguous(), temperature.float().contiguous(), top_k.to(torch.int64).contiguous(),
              top_p.float().contiguous(), min_p.float().contiguous(), seeds.to(torch.int64).contiguous(),
              offsets.to(torch.int64).contiguous(), out)
    return out


def representative_kernels():
    return [("sample", build_sample), ("greedy_sample", build_greedy),
            ("greedy_sample (programmatic dependent launch)", lambda: build_greedy(True))]
