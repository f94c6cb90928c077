"""How the walk goes through control flow: a scan's body per iteration, a shard_map's per shard, a while loop's
and a cond's branches, with values where it can and the reason where it cannot (what crosses each body's
boundary, its quantizers' evidence and the caller's, is :mod:`._boundary`'s)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp

from qcheck._coverage._records import MatmulRecord, OperandQuant
from qcheck._coverage._boundary import Evidence, splits
from qcheck._coverage._values import NOT_RUN_COND, NOT_RUN_LOOP, Val, Where, eval_eqn, scan_operands


class ControlFlow:
    """The walk's methods for loops, conds and shard_map (mixed into :class:`qcheck._coverage._walk.Walker`)."""

    def shard(self, eqn: jcore.JaxprEqn, ins: list[Val], where: Where) -> list[Val] | str:
        """A shard_map run again with its body walked with values, per shard, inside a shard_map of its own.

        Its figures and quantizer evidence come out as extra outputs, one per
        shard along a new leading axis (a figure the worst over the shards).
        Where the body cannot be run so, why not (its records then say so).
        """
        p = eqn.params
        body = p["jaxpr"]
        jaxpr, consts = (body.jaxpr, body.consts) if isinstance(body, jcore.ClosedJaxpr) else (body, [])
        mesh = p["mesh"]
        manual = next((p[k] for k in ("newly_manual_axes", "manual_axes", "axis_names") if p.get(k)),
                      frozenset(mesh.axis_names))
        per_shard = jax.sharding.PartitionSpec(tuple(a for a in mesh.axis_names if a in manual))
        template, views = self.sharded(ins, self.align(ins, jaxpr.invars), eqn, p["in_specs"], dict(mesh.shape))
        kept: dict[str, Any] = {}

        def run(*args):
            body_ins = [dataclasses.replace(t, actual=a, shadow=a) for t, a in zip(template, args)]
            outer_views, self.views = self.views, {**self.views, **views}
            try:
                outs, records, figures, evidence = self.evaluated(jaxpr, consts, body_ins, where)
            finally:
                self.views = outer_views
            kept.update(outs=outs, records=records, at=[i for i, _ in figures], evidence=evidence)
            return (tuple(o.actual for o in outs), tuple(jnp.asarray(e, jnp.float32)[None] for _, e in figures),
                    tuple(tuple(None if v is None else jnp.asarray(v)[None] for v in q) for q in evidence.quantizers))

        sizes = (len(self.records), len(self.errors), len(self.quantizers), len(self.operands))
        try:
            actual, figures, found = jax.shard_map(
                run, mesh=mesh, in_specs=tuple(p["in_specs"]), out_specs=(tuple(p["out_specs"]), per_shard, per_shard),
                axis_names=set(manual), check_vma=False)(*[v.actual for v in ins])
        except Exception as e:  # noqa: BLE001 -- the body walked without values instead, its records saying so
            self.truncate(*sizes)
            first = str(e).splitlines()[0][:160] if str(e) else ""
            return f"inside shard_map: its body could not be run per shard with values ({type(e).__name__}: {first})"
        first = self.put(kept["records"], [(i, jnp.max(e)) for i, e in zip(kept["at"], figures)], kept["evidence"],
                         found, "shard")
        grad = any(v.grad for v in ins)
        # An output split over shards is their codes side by side: along that axis, no one quantizer's axis.
        split_outs = [splits(s, dict(mesh.shape), len(getattr(v.aval, "shape", ()))) for s, v in
                  zip(p["out_specs"], eqn.outvars)]
        return [self.lifted(Val(o.quant, False, False, a, a, grad=grad, casts=o.casts, data=o.data), o,
                            kept["evidence"], first, cut=[d for d, n in enumerate(split) if n > 1])
                for o, a, split in zip(kept["outs"], actual, split_outs)]

    def control(self, eqn: jcore.JaxprEqn, ins: list[Val], where: Where, *, values: bool) -> list[Val]:
        """scan / while / cond: the bodies walked for quantization and, with values, evaluated.

        With values (``errors=True``), a loop's body is walked with them inside
        a loop of its own (``lax.scan`` / ``lax.while_loop`` on the same
        trip count): one record per matmul of the body, its error the worst
        over the iterations (:data:`NOT_RUN` where none ran). A cond's
        branches are walked inside a ``lax.switch`` on its index: the taken
        branch's matmuls get figures, the others :data:`NOT_RUN`'s reason.
        """
        name, p = eqn.primitive.name, eqn.params
        evaluate = values and where.no_values is None
        walk = dataclasses.replace(
            where, no_values=where.no_values or f"inside {name}: its body is walked for quantization only")
        start = len(self.records)
        if name == "cond":
            outs_per_branch, counts = [], []
            for b in p["branches"]:
                before = len(self.records)
                outs_per_branch.append(self.run(b.jaxpr, b.consts, self.align(ins[1:], b.jaxpr.invars), walk,
                                                values=False))
                counts.append(len(self.records) - before)
            quants = [self.agree([o[i].quant for o in outs_per_branch]) for i in range(len(eqn.outvars))]
        else:
            if name == "scan":
                body = p["jaxpr"]
                consts, carry, xs = scan_operands(p, ins)
                n_carry = len(carry)
            else:
                body, n_consts = p["body_jaxpr"], p["body_nconsts"]
                consts, carry, xs = ins[p["cond_nconsts"]:p["cond_nconsts"] + n_consts], ins[p["cond_nconsts"] + n_consts:], []
                n_carry = len(carry)
            carry_q = [v.quant for v in carry]
            # A carry is quantized only if every iteration leaves it so: iterate to a fixed point.
            for _ in range(len(carry_q) + 1):
                saved = len(self.records)
                body_ins = self.body_ins(ins, consts, carry_q, carry, xs)
                outs = self.run(body.jaxpr, body.consts, body_ins, walk, values=False)
                new_q = [q if q == o.quant else None for q, o in zip(carry_q, outs[:n_carry])]
                if new_q == carry_q:
                    break
                del self.records[saved:]
                carry_q = new_q
            quants = carry_q + [o.quant for o in outs[n_carry:]]
            if name == "while":
                quants = carry_q
        grad = any(v.grad for v in ins)
        data = any(v.data for v in ins)
        if evaluate:
            # The walk above settled each output's quantization; the same body walked again, with values, gives
            # the same records (one per matmul eqn) with their figures.
            count = len(self.records) - start
            del self.records[start:]
            if name == "cond":
                actual, shadow = self.cond_values(eqn, ins, counts, where)
                links = [Val()] * len(actual)
            else:
                actual, shadow, links = self.loop_values(eqn, ins, carry_q, count, where)
            return [dataclasses.replace(Val(q, False, False, a, s, grad=grad, data=data), qid=link.qid,
                                        axis_map=link.axis_map, live=link.live)
                    for q, a, s, link in zip(quants, actual, shadow, links)]
        actual = eval_eqn(eqn, [v.actual for v in ins]) if values else None
        return [Val(q, False, False, None if actual is None else actual[i], None if actual is None else actual[i],
                     grad=grad, data=data) for i, q in enumerate(quants)]

    @staticmethod
    def body_ins(ins: list[Val], consts: list[Val], carry_q: list[OperandQuant | None], carry: list[Val],
                 xs: list[Val]) -> list[Val]:
        """A loop body's inputs as the walk sees them (no values): the loop's consts, carry and xs."""
        # Gradient dependence is not iterated to a fixed point: any input's taints the whole body.
        grad = any(v.grad for v in ins)
        # Each input is a value of its own (a straight-through estimator x + stop_gradient(q - x) inside the
        # body tells x by it); a const is the loop's operand itself.
        # A const keeps what the walk knows of its integer bits (a stored word packing codes, a shift count); an
        # xs is one slice of its operand, elementwise the same bits (ejkernel's packed words tiled by a scan).
        return ([Val(v.quant, v.const, v.scale, grad=grad, data=v.data, ident=v.ident or object(), field=v.field,
                     stored=v.stored, known=v.known, closed=v.closed) for v in consts]
                + [Val(q, grad=grad, data=v.data, ident=object()) for q, v in zip(carry_q, carry)]
                + [Val(v.quant, grad=grad, data=v.data, ident=object(), field=v.field, stored=v.stored) for v in xs])

    def loop_values(self, eqn: jcore.JaxprEqn, ins: list[Val], carry_q: list[OperandQuant | None], count: int,
                    where: Where) -> tuple[list[Any], list[Any], list[Val]]:
        """A scan or while loop run again with the body walked with values; its outputs' values and shadows, and
        the link each keeps to the quantizer it is the codes of (a scan's ys; a carry keeps none).

        Each of the body's ``count`` records keeps the worst figure over the
        iterations (``jnp.maximum``: a NaN in any iteration stays); a record
        no iteration reached keeps :data:`NOT_RUN`'s loop sentinel.
        """
        name, p = eqn.primitive.name, eqn.params
        if name == "scan":
            body = p["jaxpr"]
            consts, carry, xs = scan_operands(p, ins)
        else:
            body, cn, bn = p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"]
            consts, carry, xs = ins[cn:cn + bn], ins[cn + bn:], []
        n_carry = len(carry)
        # A quantized carry's value before quantization travels beside it (in its own type) where it has one.
        track = [q is not None and v.shadow is not v.actual for q, v in zip(carry_q, carry)]
        track_x = [v.shadow is not v.actual for v in xs]
        template = self.body_ins(ins, consts, carry_q, carry, xs)
        # A const is the caller's value in every iteration, an xs one slice of it: both keep the caller's codes'
        # link. A carry does not: after the first iteration it is the body's own.
        const_ins = [self.linked(v, dataclasses.replace(t, actual=v.actual, shadow=v.shadow))
                     for t, v in zip(template, consts)]
        template[len(consts) + n_carry:] = [self.linked(v, t, drop=1)
                                            for t, v in zip(template[len(consts) + n_carry:], xs)]
        kept: dict[str, Any] = {}

        def step(state, x):
            c_act, c_sh, worst = state
            x_act, x_sh = x
            sh, shx = iter(c_sh), iter(x_sh)
            body_ins = const_ins + [
                dataclasses.replace(t, actual=a, shadow=next(sh) if k else a)
                for t, a, k in zip(template[len(consts):len(consts) + n_carry], c_act, track)] + [
                dataclasses.replace(t, actual=a, shadow=next(shx) if k else a)
                for t, a, k in zip(template[len(consts) + n_carry:], x_act, track_x)]
            outs, records, figures, evidence = self.evaluated(body.jaxpr, body.consts, body_ins, where)
            figures = [(i, e) for i, e in figures if i < count]
            kept["records"], kept["at"], kept["evidence"] = records, [i for i, _ in figures], evidence
            worst = list(worst)
            for i, e in figures:
                worst[i] = jnp.maximum(worst[i], e.astype(jnp.float32))
            new_sh = [o.shadow.astype(v.shadow.dtype) for o, v, k in zip(outs[:n_carry], carry, track) if k]
            ys = outs[n_carry:]
            kept["track_y"] = [o.shadow is not o.actual for o in ys]
            kept["ys"] = ys
            # A scan's quantizers come out as its outputs, one per iteration; a while loop has none to stack on.
            found = evidence.quantizers if name == "scan" else []
            return (([o.actual for o in outs[:n_carry]], new_sh, worst),
                    ([o.actual for o in ys], [o.shadow for o in ys if o.shadow is not o.actual], found))

        init = ([v.actual for v in carry], [v.shadow for v, k in zip(carry, track) if k],
                [jnp.float32(NOT_RUN_LOOP)] * count)
        if name == "scan":
            (c_act, c_sh, worst), (ys, ys_sh, found) = jax.lax.scan(
                step, init, ([v.actual for v in xs], [v.shadow for v, k in zip(xs, track_x) if k]),
                length=p["length"], reverse=p["reverse"])
        else:
            cond, cond_consts = p["cond_jaxpr"], [v.actual for v in ins[:p["cond_nconsts"]]]

            def test(state):
                return jcore.jaxpr_as_fun(cond)(*cond_consts, *state[0])[0]

            c_act, c_sh, worst = jax.lax.while_loop(test, lambda state: step(state, ([], []))[0], init)
            ys, ys_sh, found = [], [], []
        if name == "scan":
            first = self.put(kept["records"], [(i, worst[i]) for i in kept["at"]], kept["evidence"], found,
                             "iteration")
        else:
            first = self.put(kept["records"], [(i, worst[i]) for i in kept["at"]], kept["evidence"],
                             lost="inside a while loop's body: its quantizers' values are not kept per iteration")
        sh, shy = iter(c_sh), iter(ys_sh)
        shadows = [next(sh) if k else a for a, k in zip(c_act, track)]
        shadows += [next(shy) if k else a for a, k in zip(ys, kept["track_y"])]
        # A scan's ys are its iterations' values stacked: the codes a body made, multiplied after the loop.
        links = [Val()] * n_carry + [self.lifted(Val(), y, kept["evidence"], first, lead=1)
                                     for y in kept.get("ys", [])]
        return list(c_act) + list(ys), shadows, links

    def cond_values(self, eqn: jcore.JaxprEqn, ins: list[Val], counts: list[int],
                    where: Where) -> tuple[list[Any], list[Any]]:
        """A cond run again with each branch walked with values inside ``lax.switch``; its outputs' values.

        Records of branches the index does not take keep :data:`NOT_RUN`'s
        cond sentinel. Outputs carry no value before quantization (the
        branches need not agree on one).
        """
        branches, ops = eqn.params["branches"], ins[1:]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        track = [v.shadow is not v.actual for v in ops]
        kept: dict[int, tuple[list[MatmulRecord], list[int], Evidence]] = {}

        def branch(i: int, b: jcore.ClosedJaxpr):
            def run(act, sh):
                shi = iter(sh)
                template = self.align(ops, b.jaxpr.invars)
                if len(template) == len(ops):
                    template = [self.linked(v, t) for v, t in zip(ops, template)]
                body_ins = [dataclasses.replace(t, actual=a, shadow=next(shi) if k else a)
                            for t, a, k in zip(template, act, track)]
                outs, records, figures, evidence = self.evaluated(b.jaxpr, b.consts, body_ins, where)
                figures = [(j, e) for j, e in figures if j < counts[i]]
                kept[i] = records, [j for j, _ in figures], evidence
                figure = [jnp.float32(NOT_RUN_COND)] * sum(counts)
                for j, e in figures:
                    figure[offsets[i] + j] = e.astype(jnp.float32)
                return [o.actual for o in outs], figure
            return run

        actual, figure = jax.lax.switch(ins[0].actual, [branch(i, b) for i, b in enumerate(branches)],
                                        [v.actual for v in ops], [v.shadow for v, k in zip(ops, track) if k])
        for i in range(len(branches)):
            records, at, evidence = kept[i]
            self.put(records, [(j, figure[offsets[i] + j]) for j in at], evidence,
                     lost="inside a cond branch: its quantizers' values are not kept")
        return list(actual), list(actual)

    @staticmethod
    def agree(quants: list[OperandQuant | None]) -> OperandQuant | None:
        return quants[0] if all(q == quants[0] for q in quants) else None
