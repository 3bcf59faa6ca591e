"""Why ``auto`` picked this: every automatic decision of a load and a
generation, and what it is made from.

    rule.py         the modes a load builds, and which runs a batch:
                    the rule measured on one host (choose), or the cheapest
                    over the measured link (auto_choice)
    linkcost.py     the cost model: each candidate's decode step over the link
    traffic.py      what each mode puts on the wire per step
    costs.py        what the ranks measure at load: the link, the dense work
    splitcost.py    --expert-split auto: experts whole or cut in width
    split_probe.py  each cut's expert work, timed before the experts are read
    decision.py     the decision stored by rank 0 and reused at later loads

Above ``model/`` (it times the model's layers), below ``engine/``, which
asks it per generation.
"""
