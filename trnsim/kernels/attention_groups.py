"""The attention kernel's groups of query tiles in issue order, and their replay: a group that
starts in a state an earlier group started in is emitted by replaying that group
(:meth:`Kernel.replay`) instead of built again."""

from __future__ import annotations

from typing import Any


from ..isa import DmaCopy, HbmAP, HbmTensor, TileAP
from ..builder.kernel import Replay, TilePool
from .attention_stages import KeyBlock, QueryTile, Step, Work, advance, emit_batches, row_views


class Groups:
    """The groups of query tiles of the plan with the key blocks inner, in issue order: each
    group loads its queries, walks its key tiles (loading key blocks as it reaches them) and
    advances the pipeline, whose stages carry over from the group before.

    Building: from a steady state on, groups emit the same instructions up to their HBM views
    (query loads, key/value loads, output stores), so a group that starts in a state an earlier
    group started in is emitted by replaying that group (:meth:`Kernel.replay`): the same
    instructions, several times faster (``kernel.replays`` counts them). The state is the
    group's plan (query tile sizes, key tiles; with causal masking their positions too),
    whether it finds its head's key block resident (and which), the evacuation parity, the
    steps in flight (the previous groups' last key tiles: their tiles and query tiles'
    running-state tiles, compared by identity), and for each tile() call the group makes the
    pool position and the buffer it finds there (a view that tile() hands back as it is, since
    asked for the same shape and dtype). A replayed group makes the same tile() calls and sets
    the Python state (query tiles, steps, key blocks, the pipeline, the resident block, the
    evacuation count) as building it would have. Not replayed: a score function (its emitter's
    own tiles are not noted), dropout (its draws are placed by each tile's position), the
    key-blocks-outer plan, a reference build."""

    _MAX_TEMPLATES = 32  # templates kept per kernel (the default shape makes 10)

    def __init__(self, w: "Work", q: HbmTensor, k: HbmTensor, v: HbmTensor, out: HbmTensor, blocks: dict[int, int],
                 inflight: list[list[Step]]):
        self.w, self.q, self.k, self.v, self.out, self.blocks, self.inflight = w, q, k, v, out, blocks, inflight
        self.resident_ok = len(blocks) == 1
        # key -> templates (a built group's arguments to template() until a later group wants it)
        self.templates: dict[tuple[Any, ...], list[Any]] | None = \
            None if w.kern.reference or w.mod is not None or w.dropout else {}
        self.kept = 0

    def run(self, bi: int, hi: int, g0: int, specs: tuple[tuple[int, int], ...],
            plan: tuple[tuple[int, tuple[tuple[int, int, int, int], ...]], ...]) -> None:
        """The group of query tiles ``specs`` ((q0, rows) each) of head (bi, hi), starting at
        query g0; ``plan``: (block, ((tile index, block, key tile, width), ...)) per batch."""
        templates = self.templates
        if templates is None:
            self.build(bi, hi, specs, plan)
            return
        key, table = self.state(bi, hi, specs, plan)
        got = templates.get(key)
        if got is not None:
            for n, tpl in enumerate(got):
                if type(tpl) is tuple:  # a group built with this key: its template, made when first wanted
                    if not self.pools_ready(tpl[-2], tpl[-1]):
                        continue
                    tpl = got[n] = self.template(*tpl)
                if tpl is not None and self.replay(tpl, table, bi, hi, g0):
                    return
        if self.kept >= self._MAX_TEMPLATES:
            self.build(bi, hi, specs, plan)
            return
        w = self.w
        kern = w.kern
        i0, ev, resident = len(kern.instructions), w.evac, w.resident
        w.calls, w.hbm, w.new_blocks = [], [], []
        try:
            tiles, made = self.build(bi, hi, specs, plan)
            calls, hbm, new_blocks = w.calls, w.hbm, w.new_blocks
        finally:
            w.calls = w.hbm = w.new_blocks = None
        # what a template needs of the group's end, noted now (later groups change these objects);
        # the rest is worked out if a later group starts in this state
        steps = [x for x in table if type(x) is Step] + made
        qts = [x for x in table if type(x) is QueryTile] + tiles
        end = (len(kern.instructions), kern._loaded_stationary, [list(b) for b in self.inflight], w.resident,
               w.resident_of, w.evac - ev, [(st, st.p, st.pT, st.alpha) for st in steps],
               [(qt, qt.nm, qt.l, qt.o) for qt in qts])
        pools = self.pool_state(calls)
        if pools is None:
            return
        templates.setdefault(key, []).append((i0, resident, table, calls, hbm, new_blocks, tiles, made, bi, hi, g0, end,
                                              *pools))
        self.kept += 1

    def build(self, bi: int, hi: int, specs: tuple[tuple[int, int], ...],
              plan: tuple[tuple[int, tuple[tuple[int, int, int, int], ...]], ...]
              ) -> tuple[list[QueryTile], list[Step]]:
        """The group, built: its query tiles and steps."""
        w, inflight = self.w, self.inflight
        tiles = [QueryTile(bi, hi, q0, qr, w.load_queries(self.q, bi, hi, q0, qr)) for q0, qr in specs]
        qplan = [(k0, [(tiles[ti], kb0, j0, kw) for ti, kb0, j0, kw in batch]) for k0, batch in plan]
        made: list[Step] = []
        for batch in emit_batches(w, self.k, self.v, bi, hi, self.blocks, qplan, self.resident_ok):
            made.extend(batch)
            for st in batch:
                w.stage_a(st)
            inflight.insert(0, batch)
            advance(w, inflight, self.out)
        return tiles, made

    def state(self, bi: int, hi: int, specs: tuple[tuple[int, int], ...], plan: tuple[Any, ...]
              ) -> tuple[tuple[Any, ...], list[Any]]:
        """The replay key of a group about to start, and the objects it carries over (steps in
        flight, their query tiles and key blocks, the resident block if it is the group's) in a
        fixed order: the key numbers them, so equal keys mean the same sharing."""
        w = self.w
        table: list[Any] = []
        index: dict[int, int] = {}
        sig: list[Any] = []

        def ref(x: Any, attrs: Any) -> None:
            i = index.get(id(x))
            if i is None:
                index[id(x)] = len(table)
                table.append(x)
                sig.append(attrs())
            else:
                sig.append(i)

        for batch in self.inflight:
            sig.append(len(batch))
            for st in batch:
                ref(st, lambda: (st.j0, st.kw, st.last, st.p, st.pT, st.alpha))
                qt, kb = st.qt, st.kb
                ref(qt, lambda: (qt.qr, qt.nm, qt.l, qt.o))
                ref(kb, lambda: (kb.k0, kb.n, _shape_of(kb.kT), _shape_of(kb.v)))
        r = w.resident
        hit = self.resident_ok and r is not None and w.resident_of == (bi, hi)
        sig.append(hit)
        if hit:
            ref(r, lambda: (r.k0, r.n, _shape_of(r.kT), _shape_of(r.v)))
        sizes = specs if w.causal else tuple(qr for _, qr in specs)  # only causal masking reads positions
        return (sizes, plan, w.evac & 1, tuple(sig)), table

    @staticmethod
    def pool_state(calls: list[tuple[Any, ...]]) -> tuple[list[tuple[TilePool, int]], list[tuple[Any, ...]]] | None:
        """Where a group's tile() calls start in each pool and the buffer each first finds, or
        None when a call would not reuse its buffer's allocation. Each call must (then it hands
        out a view equal to the template's, which Work.tile makes the template's object): the
        first call at a position finds the buffer before the group (checked at each replay: the
        same allocation, the same partitions), a later call at the same position the one the
        earlier call left."""
        seen: dict[tuple[int, int], TileAP] = {}
        starts: dict[int, tuple[TilePool, int]] = {}
        finds = []
        for pool, i, shape, dtype, t in calls:
            starts.setdefault(id(pool), (pool, i))
            prev = seen.get((id(pool), i))
            if prev is None:
                finds.append((pool, i, t.alloc, t.p_count))
            elif prev.alloc is not t.alloc:
                return None
            seen[(id(pool), i)] = t
        return list(starts.values()), finds

    @staticmethod
    def pools_ready(starts: list[tuple[TilePool, int]], finds: list[tuple[Any, ...]]) -> bool:
        """Do the pools stand as a template's tile() calls found them?"""
        for pool, i in starts:
            if pool._next != i:
                return False
        for pool, i, alloc, parts in finds:
            old = pool._slots[i]
            if old is None or old.alloc is not alloc or old.p_count != parts:
                return False
        return True

    def template(self, i0: int, resident: KeyBlock | None, carried: list[Any], calls: list[tuple[Any, ...]],
                 hbm: list[tuple[Any, ...]], new_blocks: list[KeyBlock], tiles: list[QueryTile], made: list[Step],
                 bi: int, hi: int, g0: int, end_state: tuple[Any, ...], starts: list[tuple[TilePool, int]],
                 finds: list[tuple[Any, ...]]) -> "_GroupTemplate | None":
        """The group built from instruction ``i0`` (``end_state``: what it left, see run()) as a
        template, or None when it cannot be one (a tile() call that would not reuse its buffer's
        allocation, an HBM view not of this group, an instruction Kernel.replay_template does
        not take)."""
        kern = self.w.kern
        i1, loaded, inflight, res_now, res_of, evacs, step_attrs, tile_attrs = end_state
        ins = kern.instructions[i0:i1]
        pos = [j for j, x in enumerate(ins) if type(x) is DmaCopy and (type(x.src) is HbmAP or type(x.dst) is HbmAP)]
        if len(pos) != len(hbm) or any(e[0] is not (ins[j].src if type(ins[j].src) is HbmAP else ins[j].dst)
                                       for j, e in zip(pos, hbm)):
            return None
        table = carried + tiles + new_blocks + made
        index = {id(x): i for i, x in enumerate(table)}
        views: list[tuple[Any, ...]] = []
        for e in hbm:
            if e[1] == "q":
                if e[2:4] != (bi, hi):
                    return None
                views.append(("q", e[4] - g0, e[5]))
            elif e[1] == "rows":
                if e[3:5] != (bi, hi):
                    return None
                views.append(("rows", e[2], e[5], e[6], e[7]))
            else:
                i = index.get(id(e[2]))
                if i is None:
                    return None
                views.append(("out", i))
        try:
            end = [[index[id(st)] for st in batch] for batch in inflight]
            new_steps = [(index[id(st.qt)], index[id(st.kb)], st.j0, st.kw, st.last) for st in made]
        except KeyError:
            return None
        if res_now is resident:
            res_end = -1
        elif id(res_now) in index and res_of == (bi, hi):
            res_end = index[id(res_now)]
        else:
            return None
        # the carried key blocks are the template's parameters: their tiles' reads are replaced
        # by the same slices of the replayed group's blocks (K and V of another head)
        param: dict[Any, tuple[int, int]] = {}
        for i, x in enumerate(carried):
            if type(x) is KeyBlock:
                for which, t in enumerate((x.kT, x.v)):
                    if t.alloc in param:
                        return None
                    param[t.alloc] = (i, which)
        tiles_at, subst = [], []
        if param:
            for j, x in enumerate(ins):
                for ap in x.reads:
                    if type(ap) is TileAP and ap.alloc in param:
                        kbi, which = param[ap.alloc]
                        base = carried[kbi].kT if which == 0 else carried[kbi].v
                        tiles_at.append((j, ap))
                        subst.append((kbi, which, ap, ap.p_start - base.p_start))
                for ap in x.writes:
                    if type(ap) is TileAP and ap.alloc in param:
                        return None
        rep = kern.replay_template(i0, pos, tiles_at, (i1, loaded))
        if rep is None:
            return None
        return _GroupTemplate(
            subst, rep, views, starts, finds,
            [(pool, shape, dtype, t) for pool, _, shape, dtype, t in calls], len(carried),
            [(qt.q0 - g0, qt.qr, qt.qT) for qt in tiles], [(kb.k0, kb.n, kb.kT, kb.v) for kb in new_blocks],
            new_steps, end, [(index[id(st)], p, pT, alpha) for st, p, pT, alpha in step_attrs],
            [(index[id(qt)], nm, l, o) for qt, nm, l, o in tile_attrs], res_end, evacs)

    def replay(self, tpl: "_GroupTemplate", carried: list[Any], bi: int, hi: int, g0: int) -> bool:
        """Emit ``tpl`` again as the group at (bi, hi, g0), whose carried objects are
        ``carried`` (False, having changed nothing, when a pool is not where the template's
        calls found it or Kernel.replay refuses)."""
        rep = tpl.rep
        if not self.pools_ready(tpl.starts, tpl.finds):
            return False
        table = list(carried)
        if len(table) != tpl.n_carried:
            return False
        table += [QueryTile(bi, hi, g0 + dq, qr, qT) for dq, qr, qT in tpl.new_tiles]
        table += [KeyBlock(k0, n, kT, v) for k0, n, kT, v in tpl.new_blocks]
        table += [Step(table[qi], table[ki], j0, kw, last) for qi, ki, j0, kw, last in tpl.new_steps]
        views: list[Any] = []
        tc = self.w.tc
        for e in tpl.views:
            if e[0] == "q":
                views.append(self.q[bi, hi, g0 + e[1]:g0 + e[1] + e[2], :])
            elif e[0] == "rows":
                views.append(row_views(e[1], bi, hi, e[2], e[3], tc)[e[4]])
            else:
                qt = table[e[1]]
                views.append(self.out[qt.bi, qt.hi, qt.q0:qt.q0 + qt.qr, :])
        w = self.w
        tiles: list[TileAP] = []
        if tpl.subst:
            # the same slices for every group of the blocks' head: made once per template and blocks
            bkey = tuple(a for i in tpl.subst_blocks for a in (table[i].kT.alloc, table[i].v.alloc))
            got_tiles = tpl.moved.get(bkey)
            if got_tiles is None:
                got_tiles = tpl.moved[bkey] = self.moved_tiles(tpl.subst, table)
            tiles = got_tiles
        if not w.kern.replay(rep, views, tiles):
            return False
        assert w.canon_of is not None and w.calls is None  # w.tile hands out the canonical views, noting nothing
        for pool, shape, dtype, t in tpl.calls:  # the group's own tile() calls: each reuses its buffer
            c = w.tile(pool, shape, dtype)
            assert c is t, "attention replay: a tile() call did not give the template's view"
        for i, p, pT, alpha in tpl.step_attrs:
            st = table[i]
            st.p, st.pT, st.alpha = p, pT, alpha
        for i, nm, l, o in tpl.tile_attrs:
            qt = table[i]
            qt.nm, qt.l, qt.o = nm, l, o
        self.inflight[:] = [[table[i] for i in batch] for batch in tpl.end]
        if tpl.resident >= 0:
            w.resident, w.resident_of = table[tpl.resident], (bi, hi)
        w.evac += tpl.evacs
        return True

    def moved_tiles(self, subst: list[tuple[int, int, TileAP, int]], table: list[Any]) -> list[TileAP]:
        """The template's slices of its carried key blocks (``subst``), as the same slices of the
        blocks ``table`` carries now (one object per slice and buffer, kept in ``Work.moved``)."""
        moved, tiles = self.w.moved, []
        for kbi, which, ap, dp in subst:
            kb = table[kbi]
            base = kb.kT if which == 0 else kb.v
            a = base.alloc
            if a is ap.alloc:  # the template's own block
                tiles.append(ap)
                continue
            t = moved.get((ap, a))
            if t is None:  # the slice ``ap`` is of the template's block: the same slice of this one
                t = moved[(ap, a)] = TileAP(a, base.p_start + dp, ap.p_count, ap.offset, ap.dims, ap.dtype)
            tiles.append(t)
        return tiles


def _shape_of(t: TileAP) -> tuple[Any, ...]:
    """A tile view's geometry within its allocation (what a slice of it in another allocation keeps)."""
    return (t.alloc.space, t.alloc.nbytes, t.p_start - t.alloc.p_start, t.p_count, t.offset, t.dims, t.dtype.name)


class _GroupTemplate:
    """A group to replay (:class:`Groups`): the instructions (:class:`Replay`), the K/V block
    slices to replace (``subst``), its HBM views as recipes
    (("q", query offset in the group, rows), ("rows", tensor, first row, rows, part), ("out",
    query tile)), the pool positions and buffers its tile() calls start from / find, the calls,
    and the Python state it leaves, over a table of objects: the carried ones, then the
    group's query tiles, key blocks and steps (recipes to make them), the pipeline's batches,
    each step's and query tile's tiles, the resident block (-1: unchanged), the evacuations."""

    __slots__ = ("subst", "subst_blocks", "moved", "rep", "views", "starts", "finds", "calls", "n_carried",
                 "new_tiles", "new_blocks", "new_steps", "end", "step_attrs", "tile_attrs", "resident", "evacs")

    def __init__(self, subst: list[tuple[int, int, TileAP, int]], rep: Replay,
                 views: list[tuple[Any, ...]], starts: list[tuple[TilePool, int]],
                 finds: list[tuple[Any, ...]], calls: list[tuple[Any, ...]], n_carried: int,
                 new_tiles: list[tuple[int, int, TileAP]], new_blocks: list[tuple[int, int, TileAP, TileAP]],
                 new_steps: list[tuple[int, int, int, int, bool]], end: list[list[int]],
                 step_attrs: list[tuple[Any, ...]], tile_attrs: list[tuple[Any, ...]], resident: int, evacs: int):
        self.subst = subst  # (carried key block, kT or v, the template's slice of it, its partition offset)
        self.subst_blocks = sorted({kbi for kbi, _, _, _ in subst})
        self.moved: dict[tuple[Any, ...], list[TileAP]] = {}  # those blocks' allocations -> the slices of them
        self.rep, self.views, self.starts, self.finds, self.calls = rep, views, starts, finds, calls
        self.n_carried, self.new_tiles, self.new_blocks, self.new_steps = n_carried, new_tiles, new_blocks, new_steps
        self.end, self.step_attrs, self.tile_attrs = end, step_attrs, tile_attrs
        self.resident, self.evacs = resident, evacs
