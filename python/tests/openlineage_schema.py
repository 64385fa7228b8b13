"""Validates Strata's OpenLineage export against the schemas checked in under docs/openlineage/.

A helper for tests, not a test module itself: ``validate_events(events)`` raises on the first
event that breaks the OpenLineage spec (or one of its facet schemas) and returns None otherwise.

Everything resolves locally: the core schema and each facet schema are registered under their
``$id``, so no ``$ref`` or ``_schemaURL`` is ever fetched, and a facet whose ``_schemaURL`` names
no checked-in schema is an error rather than a silent pass.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

from jsonschema import FormatChecker, validators
from jsonschema.exceptions import best_match
from referencing import Registry, Resource

SCHEMA_DIR = Path(__file__).resolve().parent.parent.parent / "docs" / "openlineage"
CORE_SCHEMA = SCHEMA_DIR / "OpenLineage.json"

_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
_URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*$")


class InvalidEvent(ValueError):
    """An event that does not follow the checked-in schemas."""


def _formats() -> FormatChecker:
    # jsonschema checks `date-time` and `uri` only when optional packages are installed and
    # skips them silently otherwise; these stdlib checks make the result the same everywhere.
    checker = FormatChecker()

    @checker.checks("date-time", raises=ValueError)
    def _date_time(value: object) -> bool:
        if not isinstance(value, str):
            return True
        if not _RFC3339.match(value):
            return False
        datetime.fromisoformat(value.upper().replace("Z", "+00:00"))  # ranges: no month 13
        return True

    @checker.checks("uri")
    def _uri(value: object) -> bool:
        if not isinstance(value, str):
            return True
        parts = urlsplit(value)
        return bool(_URI_SCHEME.match(parts.scheme)) and not any(c.isspace() for c in value)

    @checker.checks("uuid", raises=ValueError)
    def _uuid(value: object) -> bool:
        # The canonical 8-4-4-4-12 form only: uuid.UUID alone also takes braces and urn: forms.
        return not isinstance(value, str) or (len(value) == 36 and str(uuid.UUID(value)) == value.lower())

    return checker


@lru_cache(maxsize=1)
def _schemas() -> tuple[dict, Registry, dict[str, dict]]:
    """The core schema, a registry of every checked-in schema by `$id`, and the facet schemas."""
    core = json.loads(CORE_SCHEMA.read_text())
    registry = Registry()
    facet_schemas: dict[str, dict] = {}
    for path in sorted(SCHEMA_DIR.glob("*.json")):
        schema = json.loads(path.read_text())
        if "$id" not in schema:
            raise InvalidEvent(f"{path} has no $id, so nothing can refer to it")
        registry = registry.with_resource(schema["$id"], Resource.from_contents(schema))
        if path != CORE_SCHEMA:
            facet_schemas[path.name] = schema
    return core, registry.crawl(), facet_schemas


def _validator(schema: dict, registry: Registry):
    cls = validators.validator_for(schema)  # the draft the schema declares (2020-12)
    cls.check_schema(schema)
    return cls(schema, registry=registry, format_checker=_formats())


def _facet_containers(event: dict):
    """(where, facets object) for every facet container of a run event."""
    yield "run.facets", (event.get("run") or {}).get("facets")
    yield "job.facets", (event.get("job") or {}).get("facets")
    for kind, facet_key in (("inputs", "inputFacets"), ("outputs", "outputFacets")):
        for i, dataset in enumerate(event.get(kind) or []):
            yield f"{kind}[{i}].facets", dataset.get("facets")
            yield f"{kind}[{i}].{facet_key}", dataset.get(facet_key)


def _check(validator, instance, what: str) -> None:
    # best_match: of a oneOf's many complaints, the one that most likely says what is wrong.
    error = best_match(validator.iter_errors(instance))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top)"
        raise InvalidEvent(f"{what}: at {where}: {error.message}") from error


def validate_events(events: list[dict]) -> None:
    """Raises InvalidEvent naming the first event (by index) that breaks the spec.

    Each event is checked against the core schema (docs/openlineage/OpenLineage.json, which
    must take it as a RunEvent); then every facet is checked twice: against the schema file
    that defines a facet of that name (e.g. `version` against DatasetVersionDatasetFacet.json),
    and against the schema its own `_schemaURL` names, which must be one checked in.
    """
    core, registry, facet_schemas = _schemas()
    core_validator = _validator(core, registry)
    run_event = _validator({"$ref": core["$id"] + "#/$defs/RunEvent"}, registry)
    by_facet_name = {
        name: (file, _validator(schema, registry))
        for file, schema in facet_schemas.items()
        for name in schema.get("properties", {})
    }

    if not isinstance(events, list):
        raise InvalidEvent(f"expected a list of events, got {type(events).__name__}")
    for index, event in enumerate(events):
        what = f"event {index} ({event.get('eventType', '?') if isinstance(event, dict) else '?'})"
        # As a RunEvent first: Strata sends runs only, and the core schema's top-level oneOf
        # (run, dataset or job event) would blame the whole event for any one wrong field.
        _check(run_event, event, f"{what} as a RunEvent")
        _check(core_validator, event, f"{what} against {CORE_SCHEMA.name}")
        for where, facets in _facet_containers(event):
            for name, facet in (facets or {}).items():
                if not isinstance(facet, dict):
                    raise InvalidEvent(f"{what}: {where}.{name} is not an object")
                if name in by_facet_name:
                    file, validator = by_facet_name[name]
                    _check(validator, {name: facet}, f"{what}: {where}.{name} against {file}")
                url = facet.get("_schemaURL", "")
                try:
                    registry.resolver().lookup(url)
                except Exception as e:  # referencing raises several kinds for an unknown URL
                    raise InvalidEvent(
                        f"{what}: {where}.{name}: _schemaURL {url!r} names no schema in {SCHEMA_DIR}"
                    ) from e
                _check(_validator({"$ref": url}, registry), facet, f"{what}: {where}.{name} against {url}")
