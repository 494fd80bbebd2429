"""Grid-type kernel speed: ggufkit's Numba CPU kernels vs ggml's quantizer, same thread count, one run.

For IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M, on the same F16-rounded normal weights
(0.02 sigma, rows of 4096) with a gamma-distributed imatrix:

* ``ggufkit``: ``quantize_rows_<type>`` with ``numba.set_num_threads(THREADS)``, after a warm-up row
  (compiles or loads the cached kernel and builds the grid tables);
* ``ggml``: ``ggml_quantize_chunk`` from llama-cpp-python's ``libggml-base.so`` through ctypes, rows split
  into ``THREADS`` chunks on ``THREADS`` Python threads (ctypes releases the GIL), as llama-quantize splits
  a tensor; also warmed up first (``ggml_quantize_init`` builds ggml's tables on the first call).

The bytes of both are compared. Run::

    python benchmarks/bench_quant_iq.py [ROWS] [THREADS]

Prints the CPU model, its AVX2/AVX-512 flags, and per type the seconds and ``ggufkit / ggml`` (below 1:
ggufkit is faster; the issue's target is <= 0.5).

Measured 2026-11-27 on a shared 2-core "Intel(R) Xeon(R) Processor" (AVX2, AVX-512 F/BW/CD/DQ/VL/IFMA/VBMI/
VNNI/BF16/FP16), load average 13-16 throughout (other jobs on both cores), 1024 x 4096 F16-rounded weights,
imatrix uniform in [0.01, 2.01), runs interleaved (ggml, ggufkit, ggml, ggufkit, ...), median of 5 paired
ratios ggufkit / ggml, bytes equal in every run. "Before" is the kernel as it was, timed in the same runs:

========  =======  ===================  ==================  ==================
type      path     before (1 thread)    after (1 thread)    after (2 threads)
========  =======  ===================  ==================  ==================
IQ3_XXS   ref      1.38 (1.13-1.45)     0.55 (0.38-0.65)    0.42 (0.40-0.46)
IQ3_XXS   imatrix  1.65 (1.39-1.90)     0.44 (0.42-0.53)    0.45 (0.39-0.54)
IQ3_S     ref      1.51 (1.19-1.86)     0.41 (0.27-0.65)    0.38 (0.36-0.47)
IQ3_S     imatrix  1.42 (1.26-1.47)     0.46 (0.35-0.57)    0.47 (0.44-0.52)
IQ1_M     ref      0.88 (0.81-0.93)     0.80 (0.04-0.86)*   0.90 (0.06-1.06)*
IQ1_M     imatrix  0.90 (0.79-1.24)     0.81 (0.77-1.13)    0.85 (0.76-1.00)
========  =======  ===================  ==================  ==================

(*) one run each where ggml's side was disturbed (ratio ~0.05); the medians are unaffected.

What changed for IQ3 (``ggufkit.quant.kernels.iq.iq3``): the trial scales of the grid search run side by side (the
roundings and the two sums of every trial are vector lanes, each trial's float32 operations in ggml's
order), and ``iq3_find_best_neighbour`` evaluates a list's candidates side by side over lists laid out
for it (``ggufkit.quant.kernels.iq.grids.neighbour_lanes``), written out inside the trial loop (Numba reference-
counts arrays passed to an ``inline="always"`` helper on every call). IQ1_M gained only ~10%: its time
is ggml's split search (already prefix sums in ggml), which a vector-lane version did not speed up.

IQ2 (``ggufkit.quant.kernels.iq.iq2``), same machine, 2026-11-27, imatrix path, single runs (not medians), 512 x 4096,
bytes equal in every run. Before: 1 thread 1.22 (IQ2_XXS), 1.03 (IQ2_XS), 1.59 (IQ2_S) on a quiet machine.
After, load average 2.7-3.1: 1 thread 0.57 / 0.32 / 0.62, 2 threads 0.47 / 0.29 / 0.87 (IQ2_S's 2-thread
run disturbed by the other jobs; 256-row runs gave it 0.50-0.65 on 1 thread). What changed: the same
trial-side-by-side loop and lane-laid-out neighbour search as IQ3, written out in the loop, and the lane
values stored as uint8 (the grid levels 1/3/5): the IQ2 lists are long (up to 296 candidates) and as
float32 they were 12-21 MB, which the searches streamed from memory (IQ2_XXS 0.98 -> 0.61 from that alone).

IQ2, second round (``ggufkit.quant.kernels.iq.iq2_search``), same machine, 2026-11-27, imatrix path, 256 x 4096, the
kernel before this round ("old") timed in the same process, interleaved old / ggml / new, 5 runs each, bytes
equal in every run; load average 1.9-3.2 (two other jobs on the 2 cores), so the 2-thread runs are disturbed
(ggufkit's 2-thread wall time was no lower than its 1-thread time). Ratio of the fastest runs, new (old),
wall clock: 1 thread IQ2_XXS 0.37 (0.46), IQ2_XS 0.33 (0.34), IQ2_S 0.48 (0.54); 2 threads 0.50 (0.52) /
0.27 (0.33) / 0.53 (0.65). CPU time (immune to time slicing; at 2 threads the sum over threads): 1 thread
0.46 (0.66) / 0.28 (0.29) / 0.52 (0.63); 2 threads IQ2_XXS 0.49 (0.56), IQ2_S 0.48 (0.57). This script's
single runs over this round's last commits, 512 x 4096: 1 thread 0.44-0.52 / 0.28-0.30 / 0.41-0.50, 2
threads 0.42-0.58 / 0.28-0.39 / 0.49-0.51. What changed: one lane search (``lane_search``) serves the
side-by-side trials, the sequential fallback and ggml's final pass (which had used the scalar
``find_best_neighbour``); IQ2_XXS uses 16 trial lanes (13 trials), IQ2_XS/IQ2_S 24 (19); the rounding loop
is all float32 (the packed index as ``sum(l*4^i)``, exact), which LLVM runs 8 lanes wide instead of 4;
``make_qp_quants``' first fit and 8 step trials run side by side for IQ2_XXS (its refinement passes stay
sequential: a side-by-side version that re-swept after each move measured slower); scratch is allocated once
per 8 super-blocks. Measured and left out: prefetching each search's lines (slower), the distance minimum in
the distance loop (int64 keys make that loop 4 lanes wide: slower), a second pass recomputing distances to
find the first minimum (slower). Where the rest goes (1 thread, with the search replaced by taking the first
candidate): the searches are ~45% of both types' time; skipping IQ2_S's final pass (~1 search per group of
16 weights against ~22 in the trials) saved 15-45% in two noisy runs, out of proportion to its work, which
points at per-call costs (Numba reference-counts array arguments around calls; the assembly of the
final-pass helper was full of indirect NRT calls, not counted exactly). Writing the final pass out in the
block functions then gained 3-10% on both types (same-process A/B, 64 rows, 1 thread, CPU time; not in the
numbers above). Next: fewer array arguments per call. Not measured on a quiet machine.

Final state of that round against the kernel before it, same interleaved runs (256 x 4096, 5 each, bytes
equal), load average 1.1-1.4: wall clock, fastest runs, 1 thread IQ2_XXS 0.36 (0.63), IQ2_XS 0.23 (0.28),
IQ2_S 0.46 (0.52); 2 threads 0.44 (0.55) / 0.29 (0.33) / 0.49 (0.56); CPU time, 1 thread 0.44 (0.60) /
0.23 (0.26) / 0.46 (0.56). IQ2_S stays just above the 0.45 aimed at.

IQ1 (``ggufkit.quant.kernels.iq.iq1``, ``ggufkit.quant.kernels.iq.iq1_split``), same machine, 2026-11-27, imatrix path. What
changed: the neighbour search runs over lane-laid-out candidate levels (uint8 0/1/2, only the 4513 lists a
split can produce, ~2.7 MB) with unsigned lane indices (Numba's wrap-around test on signed indices kept the
loop scalar: 1070 -> 420 ns per search, the scalar search 600); the sub-block sort is by rank (branch-free
int32 counts, 2-3x faster than the insertion sort); IQ1_S's split search computes every candidate's ratio
side by side and replays only the ones within 2^-16 of the largest with ggml's comparison (exact: the
argument is in ``iq1_split``'s docstring; ggml's scan where it does not hold), 0.085 -> 0.045 s per 1M
weights in isolation. The same for IQ1_M measured faster in isolation (0.077 -> 0.055) but not in the
kernel (its extra calls and scratch cost as much), so IQ1_M keeps ggml's scan. One-process A/B against the
kernel before, 128 x 4096, 1 thread, load ~3: IQ1_S 0.58-0.61 of the old time, IQ1_M 0.66-0.80.

All grid types after this session's merges, load average 1.0-1.7 (nothing else running), 256 x 4096,
5 interleaved runs (ggufkit, ggml, ...), median ratio (range), bytes equal in every run:

========  ===================  ===================
type      1 thread             2 threads
========  ===================  ===================
IQ2_XXS   0.62 (0.43-0.65)     0.43 (0.33-0.51)
IQ2_XS    0.23 (0.20-0.38)     0.26 (0.22-0.29)
IQ2_S     0.55 (0.36-0.76)     0.53 (0.45-1.20)
IQ3_XXS   0.38 (0.32-0.57)     0.55 (0.49-0.79)
IQ3_S     0.46 (0.37-0.58)     0.49 (0.43-0.77)
IQ1_S     0.43 (0.29-0.50)     0.54 (0.44-1.05)
IQ1_M     0.74 (0.62-1.15)     0.69 (0.56-0.79)
========  ===================  ===================

This script's single runs at the same time, 512 x 4096: 1 thread 0.41 / 0.26 / 0.49 / 0.31 / 0.31 / 0.38 /
0.54, 2 threads 0.51 / 0.38 / 0.39 / 0.39 / 0.58 / 0.46 / 0.67 (same order). Even with nothing else running
the runs of one type vary by 1.5-2x (both tools), so single figures here are within that spread.

IQ2, third round (``ggufkit.quant.kernels.iq.iq2``, ``iq2_search``), same machine, 2026-11-27, load average 3.3-4.8
throughout (three other jobs on the 2 cores), bytes equal in every run. Profile first (128 x 4096, 1
thread, rdtsc around each phase of a scratch copy): the neighbour searches 50-60% of both types, IQ2_XXS's
``make_qp_quants`` 14-19%, the trials' rounding ~10%, their sums ~9%, the final pass ~11%. The assembly of
``lane_search`` began with 14 calls to ``NRT_incref`` (and as many decrefs at the end): Numba's runtime
reference-counts every array argument on every call, an atomic each, even with ``inline="always"``. What
changed: the per-group helpers and block functions are compiled with ``_nrt=False`` (no reference counting;
they allocate nothing; numba's own string helpers do the same), the block functions' per-block
``np.zeros`` moved into the per-chunk scratch; two consecutive trials that round a sub-group to the same
off-grid point (a list is searched 5.9 times in a row on average for IQ2_S) share one pass over the list;
one int32 load gives a list's start and length; ``trials`` and ``lane_search`` are inlined. Same-process
A/B against the kernel before the round, sum over 16 single rows of the fastest of 15-25 alternating runs
(the least disturbed measure here): IQ2_S 0.75 of the old time (``_nrt=False`` alone 0.83), IQ2_XXS 0.86
(0.88). Measured and dropped: four trials per pass (1.07 against two), the off-grid trials gathered first
with a branch-free pairing (no gain), an int32 minimum inside the distance loop with a first-index pass
(no gain), the super-block's weights and their square roots computed 8 lanes wide before the groups (no
gain). Paired runs (ggufkit, ggml, ...; 256 x 4096, median (range) of 5 ratios, wall):

========  =======  ===================  ===================
type      path     1 thread             2 threads
========  =======  ===================  ===================
IQ2_XXS   imatrix  0.35 (0.31-0.53)     0.40 (0.37-0.47)
IQ2_XS    imatrix  0.25 (0.21-0.34)     0.26 (0.19-0.32)
IQ2_S     imatrix  0.39 (0.27-0.57)     0.37 (0.35-0.45)
IQ2_S     ref      0.34 (0.32-0.49)     0.33 (0.27-0.54)
========  =======  ===================  ===================

A second set, 7 runs each interleaved with the kernel before the round (new / old-kernel ratios vs ggml):
1 thread IQ2_S 0.47 / 0.51 (imatrix), 0.34 / 0.52 (ref), IQ2_XXS 0.35 / 0.47, IQ2_XS 0.21 / 0.28;
2 threads 0.37 / 0.60, 0.51 / 0.53, 0.46 / 0.56, 0.22 / 0.25. At this load the medians of one type move by
0.1-0.15 between sets; IQ2_S and IQ2_XXS are below 0.5 in every median but not yet with the margin the
noise asks for (~0.35) in all of them. Next for IQ2_S: the searches (still over half its time; a
micro-benchmark under load put a search at ~40 ns plus ~2.5 ns per lane, and IQ2_S's lists are short,
9-16 lanes, so the fixed part dominates).

Two-thread scaling of the grid kernels (``ggufkit.quant.kernels.worksharing``), same machine, 2026-11-27. Why the
2-thread ratios came out above the 1-thread ones, measured before changing anything (IQ3_XXS, IQ3_S, IQ1_S,
256 x 4096, imatrix, ggufkit and ggml interleaved in one process, per-thread times from
``/proc/self/task/*/schedstat``: time run, time waiting for a CPU, the rest asleep): (1) the split was minor:
the thread that finished its half of Numba's static split slept 0.3-6.6% of the threads' time (ggml's static
halves 0.2-3.0%), and the per-block scratch allocations cost ~0.55 us of a 60-100 us block (measured alone);
(2) this machine has ``kernel.sched_autogroup_enabled=1``, so the CPU is shared per session, not per thread:
at load average 3-4 (three other jobs) a process gets about one CPU whatever its thread count, and the 1 -> 2
thread wall-clock speed-up measured 0.9-1.1 for ggml and ggufkit alike (CPU time divided by wall time stayed
near 1 at 2 threads); the 2-thread ratio is then the 1-thread ratio plus noise; (3) per unit of work ggufkit's
threads used more CPU time at 2 threads than at 1 (12 type/kernel pairs: -12% to +23%, median +12%), ggml's
not (6 types: -9% to +28%, median 0%); not resolved (a vCPU pair sharing a host core would slow vectorized
code more than ggml's scalar loops; not measurable here). What changed: the grid kernels (IQ1_S, IQ1_M,
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) take 4 blocks at a time from a shared atomic counter, one worker per
thread, as llama-quantize hands out rows (``llama_tensor_quantize_impl``), instead of Numba's static halves: a
thread that is slowed (its core shared, a late wake-up from OpenMP's passive wait) no longer holds the other
one up. One-process A/B (kernel before / after / ggml, 7 interleaved runs, load average 3.6-4.2, bytes equal;
IQ3_XXS, IQ3_S, IQ1_S, IQ2_XXS, IQ2_S, IQ1_M): time asleep at 2 threads 0.2-6.6% -> 0.0-1.0%; IQ3_XXS with the
first half of the rows zero (cheap blocks, static halves badly unbalanced; 5 runs, load ~3.5) 46% -> 0.4%.
Median wall ratios at that load, before -> after, 1 thread / 2 threads: IQ3_XXS 0.49 -> 0.47 / 0.47 -> 0.43,
IQ3_S 0.48 -> 0.40 / 0.41 -> 0.40, IQ1_S 0.51 -> 0.62 / 0.54 -> 0.55; the 1-thread code is unchanged, so those
differences are the noise of this load. ``main`` starts Numba's threads as ggufkit does
(``start_numba_threads``: OpenMP's passive wait), not spinning after each call.

IQ3 itself: the refit after the trials (every group for IQ3_S, the off-grid ones for IQ3_XXS) searches over
the lane-laid-out lists like the trials, not with the scalar ``find_best_neighbour``: one-process A/B, 1
thread, CPU time new / old, 128 x 4096, two runs of 9 and 11 at load 4.5-6: medians 0.86-0.95 and 0.87-1.00
over IQ3_XXS/IQ3_S x imatrix/reference (single runs 0.5-2.2: too noisy for more than "5-10%"). Flattening the
trials' 2-D lane arrays measured no gain (0.92-1.10) and was left out. Final state, paired runs (ggufkit, ggml
alternating, 5 each, bytes equal), 256 x 4096, load 4.5-5.8, median wall ratios imatrix / reference: 1 thread
IQ3_XXS 0.49 / 0.46, IQ3_S 0.45 / 0.40; 2 threads IQ3_XXS 0.37 / 0.35, IQ3_S 0.37 / 0.37.

IQ1_M, next round (``ggufkit.quant.kernels.iq.iq1_split.iq1_m_search``), same machine, 2026-11-27, load average 3.2-4.8
(other jobs on both cores), 256 x 4096, 7 interleaved runs, bytes equal in every run. What changed: IQ1_M's
split search is the contender replay too (exact; argument in ``iq1_split``'s docstring, including why the
collapsed ``sumq2`` of IQ1_M still bounds the products): the 153 splits as 10 circulant rows of 16 lanes
(pairs {i, i + d mod 17}, two contiguous loads per array, 160 lanes instead of 272 for rows over i2), 4
divisions per 8 lanes, column maxima in the same loop; ggml's scan for the ~1% of groups that fall back, now
as direct loops (~6x faster than the replay over all keys it had been); the prefix sums per half add +0 to
the other half instead of selecting (3.7 -> 1.3 ms of the 128 x 4096 run: the selects had become branches);
the neighbour search finds its minimum by an int32-bits vector reduction (shared with IQ1_S; 324 -> 234 ns
per search on cached lists, 344 -> 289 on random ones). Where IQ1_M's time goes now (128 x 4096, 1 thread,
imatrix, ~40 ms): split search ~14 ms (~250 ns of its ~510 ns per group in the lane loop), neighbour search
~10-13 ms (~1 per group, ~90 candidates; much of it waiting on the 2.7 MB lane table), sort ~3 ms, prefix
sums ~1.3 ms. Tried and left out: the element loop inside the lane loop in the neighbour search (sums in
registers; slower on random lists, 289 -> 493 ns), ``inline="always"`` on it (no change), rows over i2 with
the first lane skipped (LLVM ran the 8-lane rows as scalar remainders).

Ratio ggufkit / ggml, median (range) of CPU time, in one process with the kernel before this round ("old"):

========  =======  ===================  ===================  ===================  ===================
type      path     old, 1 thread        new, 1 thread        old, 2 threads       new, 2 threads
========  =======  ===================  ===================  ===================  ===================
IQ1_M     imatrix  0.80 (0.62-1.18)     0.40 (0.35-0.47)     0.67 (0.58-0.92)     0.44 (0.40-0.49)
IQ1_M     ref      0.64 (0.36-0.78)     0.38 (0.22-0.64)     0.78 (0.48-1.00)     0.49 (0.23-0.79)
IQ1_S     imatrix  0.58 (0.46-0.86)     0.45 (0.43-0.65)     0.55 (0.38-0.93)     0.55 (0.49-0.83)
========  =======  ===================  ===================  ===================  ===================

``bench_pair`` runs right after (wall-clock medians, load 3.7-4.8): 1 thread IQ1_M 0.44 (imatrix) / 0.39
(ref), IQ1_S 0.57; 2 threads 0.54 / 0.43, IQ1_S 0.42 (IQ1_M imatrix at 2 threads ranged 0.39-0.74 there).

All grid types after merging the three rounds above (work sharing, IQ2, IQ1_M), quiet machine (load
average 1.0-1.5, nothing else running), 2026-11-27, ggufkit and ggml alternating in one process with
Numba's threads started as ggufkit starts them, bytes equal in every run. 256 x 4096, 5 runs, median wall
ratio, imatrix / reference:

========  ===========  ===========
type      1 thread     2 threads
========  ===========  ===========
IQ2_XXS   0.33         0.33
IQ2_XS    0.22         0.23
IQ2_S     0.36 / 0.32  0.33 / 0.32
IQ3_XXS   0.41 / 0.57  0.36 / 0.37
IQ3_S     0.41 / 0.55  0.38 / 0.39
IQ1_S     0.66         0.56
IQ1_M     0.41 / 0.39  0.47 / 0.44
========  ===========  ===========

The single ratios of one type range 1.5-2x even here (IQ3_S reference at 1 thread 0.30-0.78), so the
types above 0.5 were run again, 512 x 4096, 9 runs: 1 thread IQ3_XXS 0.38 / 0.34, IQ3_S 0.38 / 0.36, IQ1_S
0.52 (CPU time per call, 256 x 4096, 12 runs: ggufkit 0.093-0.14 s, median ~0.10; ggml 0.18-0.27 s), IQ1_M
0.45 / 0.45, IQ2_XXS 0.39; 2 threads IQ1_S 0.45 (CPU 0.50), IQ1_M 0.37 / 0.40, IQ2_XXS 0.34. IQ1_S is the one
type still about half of ggml's time rather than below it (compiling its per-group helpers without reference
counting, as IQ2's are, gained 2-3% in a one-process A/B and was left out).

IQ1_S, next round (``ggufkit.quant.kernels.iq.iq1``, ``iq1_split.iq1_s_search``), same machine, 2026-11-27, load average
1.2-2.7 (two other jobs sharing the 2 cores). Where the time went first (64 x 4096, 1 thread,
imatrix, the stages timed apart on fixed data: prefix sums and split results stored, then each stage alone,
min of 15-21 runs), ~3.1 us per 32-weight group in all: split search ~1.7 us (lane loop ~0.9, column maxima
~0.25, contenders ~0.15, replay incl. ggml's scan ~0.4), neighbour search ~0.75 (2.0 searches per group,
~90 candidates each), sort ~0.4, weights and prefix sums ~0.1, the rest ~0.3 (the per-block allocations among it). The
replay's 0.4 was the fall-back: 3.7% of the groups had a ratio in the gap just below the contender threshold
(near-equal ratios of splits across a near-zero weight, common with a gamma-distributed imatrix), and each
then ran ggml's whole scan (1122 keys built in a fresh array, replayed). What changed: (1) where the gap below
the threshold holds a ratio, the threshold drops to the gap's lower end, up to 4 times (the contender
argument holds for any threshold with an empty gap below it; ``iq1_split``'s docstring): fall-backs 305 ->
1 of 8192 groups; ggml's scan itself as direct loops without an allocation; (2) the split helpers, the block
function, the sort and the neighbour search compiled with ``_nrt=False`` and the block's scratch allocated
once per worker (about 15 arrays per block before): the split search 1.66 -> 1.13 us per group with (1);
(3) the sort by rank accumulates every element's rank at once, one comparand at a time (no horizontal sum
per element): 328 -> 221 ns per group; (4) the 561 splits as 17 circulant rows of 40 lanes (pairs {a, a + d
mod 33}, as IQ1_M's) instead of 33 rows over i2 >= i1: 0.62-0.85 of the split search's time. Now ~1.9 us
per group: split search ~0.93 (lane loop ~0.78), neighbour search ~0.6, sort ~0.22, weights and sums ~0.15.
Tried and left out (no gain measurable at this load, 3-6 interleaved one-process runs each): the column
maxima in a separate pass (as before), one division for both signs (``1/(tp*tm)``) with the squared levels
as constants behind a weights-ordered check, the neighbour search's eight element passes fused into two, its
first-minimum lane found by a vector minimum instead of a scalar scan; a 2-bit packed level table (0.68 MB
instead of 2.7 MB, which exceeds a core's 2 MB L2) made a search 7-13% faster in isolation (~2% of the
kernel) and was not taken over.

One process, the kernel before this round ("old"), the new one and ggml interleaved (9 runs each, bytes
equal in every run), median ratio to ggml (range):

===========  =========  ===================  ===================  ==================  ==========
rows         threads    old, wall            new, wall            new, CPU time       new / old
===========  =========  ===================  ===================  ==================  ==========
256 x 4096   1          0.49 (0.01-0.77)*    0.33 (0.01-0.60)*    0.33                0.62
256 x 4096   2          0.54 (0.32-0.89)     0.35 (0.31-0.50)     0.34 (0.30-0.42)    0.63
512 x 4096   1          0.54 (0.42-0.70)     0.33 (0.26-0.49)     0.33 (0.26-0.50)    0.60
512 x 4096   2          0.44 (0.36-0.60)     0.35 (0.26-0.53)     0.34 (0.25-0.52)    0.69
===========  =========  ===================  ===================  ==================  ==========

(*) one ggml run of that set took ~100x its usual time (the 0.01s); the medians are unaffected. The paired
ggufkit/ggml script right after (7 runs, wall medians): 256 x 4096 1 thread 0.37, 2 threads 0.32; 512 x 4096
0.29 / 0.29. An earlier set of 7 (load 1.6-1.7): 0.36 / 0.31 / 0.35 / 0.36.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ggml_oracle import libggml, row_bytes

from ggufkit.quant import KERNELS
from ggufkit.quant.dispatch import start_numba_threads

QT = GGMLQuantizationType
TYPES = [QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M]
N_PER_ROW = 4096


def _cpu() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return f"{model}; AVX2 {'avx2' in flags}, AVX-512F {'avx512f' in flags}"


def _ggml(x: np.ndarray, qw: np.ndarray, qtype: QT, threads: int) -> np.ndarray:
    lib = libggml()
    out = np.zeros((x.shape[0], row_bytes(qtype, x.shape[1])), np.uint8)
    bounds = np.linspace(0, x.shape[0], threads + 1).astype(int)

    def chunk(i: int) -> None:
        r0, r1 = int(bounds[i]), int(bounds[i + 1])
        lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, r0 * x.shape[1], r1 - r0, x.shape[1],
                                qw.ctypes.data)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(chunk, range(threads)))
    return out


def main(rows: int = 64, threads: int = 2) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows, N_PER_ROW), dtype=np.float32) * np.float32(0.02)).astype(np.float16)
    x = x.astype(np.float32)
    qw = rng.gamma(0.5, 2.0, N_PER_ROW).astype(np.float32)
    start_numba_threads()  # OpenMP's passive wait, as ggufkit.quant.quantize runs the kernels
    numba.set_num_threads(threads)
    print(f"{_cpu()}\n{rows} x {N_PER_ROW} = {rows * N_PER_ROW / 1e6:.2f}M weights, imatrix, {threads} threads")
    for qtype in TYPES:
        quantize_rows, _ = KERNELS[qtype].cpu()
        ours = np.zeros((rows, row_bytes(qtype, N_PER_ROW)), np.uint8)
        quantize_rows(x[:1], qw, ours[:1])  # warm-up: kernel compile/cache load, grid tables
        _ggml(x[:threads], qw, qtype, threads)  # warm-up: ggml_quantize_init
        t0 = time.perf_counter()
        quantize_rows(x, qw, ours)
        t1 = time.perf_counter()
        ref = _ggml(x, qw, qtype, threads)
        t2 = time.perf_counter()
        same = "bytes equal" if np.array_equal(ours, ref) else "BYTES DIFFER"
        print(f"{qtype.name:8s} ggufkit {t1 - t0:7.3f} s  ggml {t2 - t1:7.3f} s  ggufkit/ggml "
              f"{(t1 - t0) / (t2 - t1):5.2f}  {same}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
