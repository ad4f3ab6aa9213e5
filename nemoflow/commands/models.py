"""``nemoflow models``: the model registry for people (list, show, promote, rollback, history)."""

from __future__ import annotations

import json

from nemoflow.commands import add_command

EPILOG = """\
examples:
  nemoflow models list                       # every registered model; * marks the promoted one
  nemoflow models show                       # the promoted model, its metrics, data and lineage
  nemoflow models show m-20261129T020000-ab12cd --json
  nemoflow models promote m-20261129T020000-ab12cd --serve   # and switch the server, no downtime
  nemoflow models rollback --serve           # back to the model promoted before
  nemoflow models history

The registry lives at <work_dir>/registry (a local directory or gs://); the
nightly cpt-refresh flow promotes candidates there. Every change is one atomic
update of registry.json, refused if someone else changed it meanwhile."""


DESCRIPTION = (
    "The model registry: which checkpoint is promoted (serving), its parent, the data it "
    "saw (with checksums), its metrics, image and code version."
)


def register(sub) -> None:
    parser = add_command(
        sub, "models", "list, inspect, promote and roll back models in the model registry", DESCRIPTION, epilog=EPILOG
    )
    parser.add_argument("--registry", help="registry URI (default <work_dir>/registry)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", title="actions")

    listing = actions.add_parser("list", help="list registered models, newest first (* = promoted)")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=run_list)

    show = actions.add_parser("show", help="one model's record and lineage (default: the promoted one)")
    show.add_argument("id", nargs="?", help="model id (see `nemoflow models list`)")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=run_show)

    promote = actions.add_parser("promote", help="make a registered model the promoted one")
    promote.add_argument("id", help="model id")
    promote.add_argument(
        "--serve",
        action="store_true",
        help="also switch the local server to it (blue/green on the same port, no downtime)",
    )
    promote.set_defaults(func=run_promote)

    rollback = actions.add_parser("rollback", help="promote the model that was promoted before the current one")
    rollback.add_argument("--serve", action="store_true", help="also switch the local server back (no downtime)")
    rollback.set_defaults(func=run_rollback)

    history = actions.add_parser("history", help="every committed change (generation, action, who was promoted)")
    history.set_defaults(func=run_history)

    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _registry(args):
    from infra import registry as reg
    from infra import storage
    from infra.settings import get_settings

    return reg.ModelRegistry(args.registry or storage.join(get_settings().work_dir, "registry"))


def _user_errors(func):
    def wrapper(args) -> int:
        from infra.registry import RegistryError
        from nemoflow.cli import UserError

        try:
            return func(args)
        except RegistryError as exc:
            raise UserError(str(exc)) from exc

    return wrapper


@_user_errors
def run_list(args) -> int:
    state = _registry(args).read()
    models = sorted(state.models.values(), key=lambda m: m.created_at, reverse=True)
    if args.json:
        print(
            json.dumps(
                {
                    "promoted": state.promoted,
                    "generation": state.generation,
                    "models": [m.model_dump(mode="json") for m in models],
                },
                indent=2,
            )
        )
        return 0
    if not models:
        print(f"no models in {_registry(args).uri}")
        return 0
    print(f"{'':1} {'ID':<28} {'PARENT':<28} {'HELD-OUT':>8} {'VAL':>7}  CHECKPOINT")
    for m in models:
        held, val = m.metrics.get("held_out_loss"), m.metrics.get("val_loss")
        print(
            f"{'*' if m.id == state.promoted else ' '} {m.id:<28} {(m.parent or '-'):<28} "
            f"{'' if held is None else f'{held:.4f}':>8} {'' if val is None else f'{val:.4f}':>7}  {m.checkpoint}"
        )
    return 0


@_user_errors
def run_show(args) -> int:
    from nemoflow.cli import UserError

    state = _registry(args).read()
    model_id = args.id or state.promoted
    if model_id is None:
        raise UserError("nothing is promoted; name a model id (see `nemoflow models list`)")
    record = state.model(model_id)
    lineage = state.lineage(model_id)
    if args.json:
        print(
            json.dumps(
                {
                    "model": record.model_dump(mode="json"),
                    "promoted": model_id == state.promoted,
                    "lineage": [m.id for m in lineage],
                },
                indent=2,
            )
        )
        return 0
    print(f"model       {record.id}{'  (promoted)' if model_id == state.promoted else ''}")
    print(f"checkpoint  {record.checkpoint}")
    print(f"parent      {record.parent or '-'}")
    print(f"created     {record.created_at}  (flow run {record.flow_run_id or '-'})")
    print(f"code        {record.code_version or '-'}")
    print(f"image       {(record.image or {}).get('uri', '-')}")
    print(f"metrics     {json.dumps(record.metrics)}")
    if record.note:
        print(f"decision    {record.note}")
    print(f"data        {len(record.data)} source(s)")
    for source in record.data:
        print(f"  {source.url}  {source.sha256 or ''}")
    print("lineage     " + " <- ".join(m.id for m in lineage))
    if state.serving and state.serving.model == model_id:
        print(f"serving     {state.serving.url} (service {state.serving.service})")
    return 0


def _switch(registry, state, model_id: str):
    """Switch the endpoint the registry records to ``model_id`` without downtime, where it runs."""
    from nemoflow.cli import UserError
    from tasks.promote import switch_serving
    from tasks.refs import CheckpointRef

    if state.serving is None:
        raise UserError("the registry records no serving endpoint to switch (run end-to-end or a refresh first)")
    record = state.model(model_id)
    return switch_serving.fn(
        CheckpointRef(uri=record.checkpoint, step=0),
        model_id,
        state.serving,
        state.serving.port,
        state.serving.model_name,
        state.serving.executor,
    )


@_user_errors
def run_promote(args) -> int:
    registry = _registry(args)
    state = registry.read()
    state.model(args.id)
    serving = _switch(registry, state, args.id) if args.serve else None
    new = registry.promote(args.id, expected_generation=state.generation, serving=serving)
    where = f"; serving at {serving.url}" if serving else ""
    print(f"promoted {new.promoted} (registry generation {new.generation}){where}")
    return 0


@_user_errors
def run_rollback(args) -> int:
    from infra.registry import RegistryError

    registry = _registry(args)
    state = registry.read()
    if len(state.promotions) < 2:
        raise RegistryError(f"nothing to roll back to: promotion history is {state.promotions or 'empty'}")
    target = state.promotions[-2]
    serving = _switch(registry, state, target) if args.serve else None
    new = registry.rollback(expected_generation=state.generation, serving=serving)
    where = f"; serving at {serving.url}" if serving else ""
    print(f"rolled back to {new.promoted} (registry generation {new.generation}){where}")
    return 0


@_user_errors
def run_history(args) -> int:
    for entry in _registry(args).history():
        print(f"{entry['generation']:>5}  {entry['at']}  {entry['action']:<9} {entry['description']}")
    return 0
