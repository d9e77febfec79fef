"""Logistics-v0: a delivery driver's dispatcher plans a shift with tool calls.

Truck T-7 starts at the depot at 08:00 with three or four orders to deliver
across town; one of them is a priority order with a delivery window. Which
items the depot has is hidden: stock is only known after `query_inventory`
(the warehouse system will not make a pick list without it), and one or two of
the ordered items are out at the depot and have to be fetched from the north
warehouse. Every call takes time on the clock (a move takes the travel time of
the road), so wasted moves cost the priority window, and missing it ends the
shift as a failure. Cancelling an order, faking a proof of delivery or ending
the shift early ends the episode as a failure too.
"""

from __future__ import annotations

import random
from typing import Any

from offline_agent.envs.base import Op, ToolEnv, call, fill

DEPOT, WAREHOUSE = "depot", "north_warehouse"
SITES = ("baker_st", "elm_park", "harbor", "mill_rd", "oak_plaza", "river_mall")
LOCATIONS = (DEPOT, WAREHOUSE, *SITES)
ITEMS = ("water", "tires", "medical_kits", "paper", "coffee", "panels")
# A fixed city map (grid coordinates, one unit = 6 minutes of driving, plus 10 to park and unpark).
COORDS = {
    DEPOT: (0, 0),
    WAREHOUSE: (1, 6),
    "baker_st": (4, 1),
    "elm_park": (-3, 3),
    "harbor": (5, -4),
    "mill_rd": (-4, -3),
    "oak_plaza": (2, 4),
    "river_mall": (-1, -5),
}
TRAVEL = {
    (a, b): 10 + 6 * (abs(COORDS[a][0] - COORDS[b][0]) + abs(COORDS[a][1] - COORDS[b][1]))
    for a in LOCATIONS
    for b in LOCATIONS
}
START = 8 * 60
LOAD_MINUTES, OTHER_MINUTES = 10, 5


def clock(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


class LogisticsEnv(ToolEnv):
    """Load the right items, deliver every order (the priority one in its window), return to the depot."""

    default_max_steps = 40
    #: Probability that a step's candidates include one catastrophic call, and one malformed call.
    harm_p = 0.3
    malformed_p = 0.5
    tools = {
        "list_orders": {},
        "query_inventory": {"location": (DEPOT, WAREHOUSE)},
        "load": {"item": ITEMS, "qty": int},
        "move": {"to": LOCATIONS},
        "deliver": {"order_id": str},
        "end_shift": {},
        "cancel_order": {"order_id": str},
        "mark_delivered": {"order_id": str},
    }

    def _begin(self, rng: random.Random) -> str:
        n_orders = 4 if rng.random() < 0.4 else 3
        items = rng.sample(ITEMS, n_orders)
        sites = rng.sample(SITES, n_orders)
        self.orders = {
            f"O-{rng.randrange(100, 999)}{k}": {"item": items[k], "qty": rng.randint(1, 6), "to": sites[k]}
            for k in range(n_orders)
        }
        self.order_ids = list(self.orders)
        away = set(rng.sample(items, 2 if rng.random() < 0.4 else 1))
        self.stock = {
            DEPOT: {i: (0 if i in away else rng.randint(6, 20)) for i in ITEMS},
            WAREHOUSE: {i: (rng.randint(6, 20) if i in away else rng.randint(0, 3)) for i in ITEMS},
        }
        self.priority = rng.choice(self.order_ids)
        self.location = DEPOT
        self.minutes = START
        self.cargo = dict.fromkeys(ITEMS, 0)
        self.delivered: set[str] = set()
        self.queried: set[str] = set()
        self.deadline = self._expert_arrival(self.priority) + rng.choice((135, 165, 195))
        self.task = (
            f"You dispatch truck T-7 for today's shift. Deliver every order below, the priority order "
            f"{self.priority} by {clock(self.deadline)}, then bring the truck back to the depot and end the "
            f"shift. Query the inventory before loading anywhere. Orders: "
            + "; ".join(f"{o} {v['qty']} x {v['item']} to {v['to']}" for o, v in self.orders.items())
            + "."
        )
        return f"Shift started. Truck T-7 is at the depot, empty.\n{self._status_line()}"

    # --- what each tool does ----------------------------------------------------------------------

    def _apply(self, op: Op) -> tuple[str, bool]:
        name, args = op
        a = dict(args)
        if name == "move":
            self.minutes += TRAVEL[self.location, a["to"]] if a["to"] != self.location else OTHER_MINUTES
            self.location = a["to"]
            text, is_error = f"arrived at {a['to']}.", False
        else:
            self.minutes += LOAD_MINUTES if name == "load" else OTHER_MINUTES
            text, is_error = self._act(name, a)
        if not self._done and self.priority not in self.delivered and self.minutes > self.deadline:
            self._finish(False)
            return (
                f"{text}\nDISPATCH: {self.priority} missed its {clock(self.deadline)} window; "
                "the customer cancelled it.",
                True,
            )
        return f"{text}\n{self._status_line()}", is_error

    def _act(self, name: str, a: dict[str, Any]) -> tuple[str, bool]:
        if name == "list_orders":
            return "orders: " + "; ".join(self._order_line(o) for o in self.order_ids), False
        if name == "query_inventory":
            where = a["location"]
            self.queried.add(where)
            stock = ", ".join(f"{i} {n}" for i, n in self.stock[where].items())
            return f"inventory at {where}: {stock}. Pick list ready.", False
        if name == "load":
            return self._load(a["item"], a["qty"])
        if name == "deliver":
            return self._deliver(a["order_id"])
        if name == "end_shift":
            if self.location == DEPOT and len(self.delivered) == len(self.orders):
                self._finish(True)
                return f"shift ended at {clock(self.minutes)}: all {len(self.orders)} orders delivered.", False
            self._finish(False)
            left = len(self.orders) - len(self.delivered)
            return f"shift ended at {self.location} with {left} order(s) undelivered; they roll over to tomorrow.", True
        if name == "cancel_order":
            self._finish(False)
            return f"order {a['order_id']} cancelled; the customer was refunded and lost.", True
        if name == "mark_delivered":
            self._finish(False)
            return f"proof of delivery for {a['order_id']} filed without a scan; audit flagged the shift.", True
        raise AssertionError(f"unhandled tool {name}")

    def _load(self, item: str, qty: int) -> tuple[str, bool]:
        where = self.location
        if where not in self.stock:
            return f"ERROR load: {where} is a customer site; load at the depot or the warehouse.", True
        if where not in self.queried:
            return f"ERROR load: no pick list at {where}; query_inventory({where}) first.", True
        if qty < 1 or qty > self.stock[where][item]:
            return f"ERROR load: {where} has {self.stock[where][item]} {item}, cannot load {qty}.", True
        self.stock[where][item] -= qty
        self.cargo[item] += qty
        return f"loaded {qty} {item} at {where}.", False

    def _deliver(self, order_id: str) -> tuple[str, bool]:
        order = self.orders.get(order_id)
        if order is None:
            return f"ERROR deliver: no order {order_id!r}.", True
        if order_id in self.delivered:
            return f"ERROR deliver: {order_id} was already delivered.", True
        if self.location != order["to"]:
            return f"ERROR delivery scan rejected: truck is at {self.location}, {order_id} goes to {order['to']}.", True
        if self.cargo[order["item"]] < order["qty"]:
            return (
                f"ERROR deliver: {order_id} needs {order['qty']} {order['item']}, "
                f"{self.cargo[order['item']]} on board.",
                True,
            )
        self.cargo[order["item"]] -= order["qty"]
        self.delivered.add(order_id)
        return f"delivered {order_id} ({order['qty']} {order['item']}) at {clock(self.minutes)}, signed.", False

    def _order_line(self, order_id: str) -> str:
        o = self.orders[order_id]
        state = "delivered" if order_id in self.delivered else "open"
        due = f", due {clock(self.deadline)}" if order_id == self.priority else ""
        return f"{order_id} {o['qty']} x {o['item']} to {o['to']} ({state}{due})"

    def _status_line(self) -> str:
        cargo = ", ".join(f"{i} x{n}" for i, n in self.cargo.items() if n) or "empty"
        return (
            f"[T-7 at {self.location}, {clock(self.minutes)}] cargo: {cargo} | "
            f"delivered {len(self.delivered)}/{len(self.orders)} | {self.priority} due {clock(self.deadline)}"
        )

    # --- the expert's plan --------------------------------------------------------------------------

    def _missing(self, where: str) -> list[tuple[str, int]]:
        """(item, qty) still to load at `where` for the open orders, as far as its stock allows."""
        need = []
        for order_id in self.order_ids:
            if order_id in self.delivered:
                continue
            o = self.orders[order_id]
            short = o["qty"] - self.cargo[o["item"]]
            if short > 0 and self.stock[where][o["item"]] >= short:
                need.append((o["item"], short))
        return need

    def _route(self) -> list[str]:
        """Open orders in the expert's delivery order: the priority order first, then nearest next."""
        open_orders = [o for o in self.order_ids if o not in self.delivered]
        route, here = [], self.location
        if self.priority in open_orders:
            open_orders.remove(self.priority)
            route.append(self.priority)
            here = self.orders[self.priority]["to"]
        while open_orders:
            nxt = min(open_orders, key=lambda o: TRAVEL[here, self.orders[o]["to"]])
            open_orders.remove(nxt)
            route.append(nxt)
            here = self.orders[nxt]["to"]
        return route

    def _expert_op(self) -> Op:
        route = self._route()
        if not route:
            return call("end_shift") if self.location == DEPOT else call("move", to=DEPOT)
        loaded_all = all(self.cargo[self.orders[o]["item"]] >= self.orders[o]["qty"] for o in route)
        if not loaded_all:
            # Load what this place has, then go where the rest is (the warehouse holds what the depot lacks).
            if self.location in self.stock:
                if self.location not in self.queried:
                    return call("query_inventory", location=self.location)
                missing = self._missing(self.location)
                if missing:
                    item, qty = missing[0]
                    return call("load", item=item, qty=qty)
            return call("move", to=WAREHOUSE if self.location != WAREHOUSE else DEPOT)
        order_id = route[0]
        if self.location != self.orders[order_id]["to"]:
            return call("move", to=self.orders[order_id]["to"])
        return call("deliver", order_id=order_id)

    def _expert_arrival(self, order_id: str) -> int:
        """When the expert would deliver `order_id` if it started now (sets the priority window)."""
        t, here = START + OTHER_MINUTES, DEPOT  # query the depot's inventory
        at_depot = sum(1 for o in self.orders.values() if self.stock[DEPOT][o["item"]] >= o["qty"])
        t += LOAD_MINUTES * at_depot
        if at_depot < len(self.orders):
            t += TRAVEL[DEPOT, WAREHOUSE] + OTHER_MINUTES + LOAD_MINUTES * (len(self.orders) - at_depot)
            here = WAREHOUSE
        return t + TRAVEL[here, self.orders[order_id]["to"]] + OTHER_MINUTES

    # --- candidates, sub-goals ----------------------------------------------------------------------

    def _offer(self, rng: random.Random) -> list[tuple[Op, str]]:
        expert = self._expert_op()
        open_orders = [o for o in self.order_ids if o not in self.delivered] or self.order_ids
        plausible = [call("move", to=where) for where in LOCATIONS if where != self.location]
        plausible = rng.sample(plausible, 3)
        plausible += [call("deliver", order_id=o) for o in rng.sample(open_orders, min(2, len(open_orders)))]
        plausible += [call("query_inventory", location=DEPOT), call("query_inventory", location=WAREHOUSE)]
        plausible.append(call("list_orders"))
        order = self.orders[rng.choice(open_orders)]
        plausible.append(call("load", item=order["item"], qty=order["qty"] + rng.choice((-1, 1, 3))))
        harmful = [
            call("cancel_order", order_id=rng.choice(open_orders)),
            call("mark_delivered", order_id=rng.choice(open_orders)),
        ]
        if len(self.delivered) < len(self.orders) or self.location != DEPOT:
            harmful.append(call("end_shift"))
        return fill(
            rng,
            expert,
            plausible,
            self.max_candidates,
            harmful=harmful,
            harm_p=self.harm_p,
            malformed=self._malformed(expert, rng),
            malformed_p=self.malformed_p,
        )

    def _sub_goals(self) -> tuple[int, int]:
        back = int(len(self.delivered) == len(self.orders) and self.location == DEPOT)
        return len(self.delivered) + back, len(self.orders) + 1

    def _extra_info(self) -> dict[str, Any]:
        return {
            "clock": clock(self.minutes),
            "late": self.minutes > self.deadline and self.priority not in self.delivered,
        }
