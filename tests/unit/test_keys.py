"""Unit tests for core/keys.py, core/encoding.py and core/arguments.py: canonical encoding,
argument binding, key names."""

from __future__ import annotations

import ast
import collections
import datetime as dt
import decimal
import enum
import inspect
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from celery_singleton_lock.core import arguments, encoding, keys
from celery_singleton_lock.core.arguments import bind_arguments, check_key_args
from celery_singleton_lock.core.encoding import canonical_encode
from celery_singleton_lock.core.keys import (
    MAX_NAME_CHARS,
    LockKeys,
    argument_digest,
    check_prefix,
    derive_keys,
    leader_keys,
    lock_key_problem,
    lock_keys,
    queued_key,
    run_claim_key,
    safe_name,
)
from celery_singleton_lock.errors import SingletonConfigError, SingletonKeyError

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = "test:"
TASK = "app.tasks.sync"


def f(a: Any, full: bool = False) -> None:
    """Task body used to derive keys."""


def g(a: Any, *rest: Any, **extra: Any) -> None:
    """Task body with *args and **kwargs."""


def h(obj: Any) -> None:
    """Task body taking one object."""


def three(a: Any, b: Any, c: Any = 3) -> None:
    """Task body with three parameters."""


class Worker:
    """Holds a task body as a method."""

    def run(self, a: Any, full: bool = False) -> None:
        """Method task body (bound: self is not an argument)."""


class Foo:
    """A type the encoding does not support."""


class Color(enum.Enum):
    """An enum with int values."""

    RED = 1
    GREEN = 2


class Shade(enum.Enum):
    """Another enum sharing Color's values."""

    RED = 1


class Level(enum.IntEnum):
    """An IntEnum."""

    LOW = 1


class MyStr(str):
    """A str subclass."""


class MyInt(int):
    """An int subclass."""


class Point(NamedTuple):
    """A tuple subclass."""

    x: int
    y: int


def key_of(value: object) -> LockKeys:
    """Keys of ``h(value)``."""
    return derive_keys(PREFIX, TASK, h, [value], {})


def hash_tag(key: str) -> str:
    """The Redis Cluster hash tag of ``key`` (text between the first { and the next })."""
    start = key.index("{")
    end = key.index("}", start + 1)
    return key[start + 1 : end]


# --------------------------------------------------------------------------- binding


def test_positional_keyword_and_default_give_one_key() -> None:
    """f(1), f(a=1) and f(1, full=False) share one key."""
    calls: list[tuple[list[Any], dict[str, Any]]] = [
        ([1], {}),
        ([], {"a": 1}),
        ([1], {"full": False}),
        ([1, False], {}),
    ]
    found = {derive_keys(PREFIX, TASK, f, args, kwargs) for args, kwargs in calls}
    assert len(found) == 1
    assert derive_keys(PREFIX, TASK, f, [1], {"full": True}) not in found


def test_bound_method_binds_without_self() -> None:
    """A bound method's arguments bind without self and match the plain function's key."""
    assert bind_arguments(Worker().run, [1], {}) == {"a": 1, "full": False}
    assert derive_keys(PREFIX, TASK, Worker().run, [1], {}) == derive_keys(PREFIX, TASK, f, [1], {})


def test_var_positional_and_var_keyword_keep_their_containers() -> None:
    """A *args parameter keeps its tuple and a **kwargs parameter its dict."""
    assert bind_arguments(g, [1, 2, 3], {"k": 4}) == {"a": 1, "rest": (2, 3), "extra": {"k": 4}}
    assert bind_arguments(g, [1], {}) == {"a": 1, "rest": (), "extra": {}}


def test_bind_failure_raises_key_error_with_type_error_text() -> None:
    """Arguments that do not fit the signature raise SingletonKeyError with the TypeError text."""
    with pytest.raises(SingletonKeyError, match="too many positional arguments") as info:
        bind_arguments(f, [1, 2, 3], {})
    assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(SingletonKeyError, match="missing a required argument: 'a'"):
        derive_keys(PREFIX, TASK, f, [], {})


def test_key_args_selects_subset_in_given_order() -> None:
    """key_args keeps only the named parameters, in the order given."""
    bound = bind_arguments(three, [1, 2], {}, key_args=["c", "a"])
    assert list(bound.items()) == [("c", 3), ("a", 1)]
    first = derive_keys(PREFIX, TASK, three, [1, 2], {}, key_args=["a"])
    second = derive_keys(PREFIX, TASK, three, [1, 99], {"c": 7}, key_args=["a"])
    other = derive_keys(PREFIX, TASK, three, [2, 2], {}, key_args=["a"])
    assert first == second != other
    assert derive_keys(PREFIX, TASK, three, [1, 2], {}, key_args=["a", "c"]) == derive_keys(
        PREFIX, TASK, three, [1, 2], {}, key_args=["c", "a"]
    )


def test_key_args_unknown_name_raises_config_error() -> None:
    """A key_args name that is not a parameter raises SingletonConfigError naming it."""
    with pytest.raises(SingletonConfigError, match="'nope'"):
        bind_arguments(three, [1, 2], {}, key_args=["a", "nope"])
    with pytest.raises(SingletonConfigError, match="'nope'"):
        check_key_args(three, ["nope"])
    with pytest.raises(SingletonConfigError, match="'nope'"):
        derive_keys(PREFIX, TASK, three, [1, 2], {}, key_args=["nope"])


def test_check_key_args_accepts_known_names_and_rejects_a_bare_string() -> None:
    """check_key_args passes for real names and None, and rejects a str given as the list."""
    check_key_args(three, ["a", "c"])
    check_key_args(three, None)
    check_key_args(Worker().run, ["full"])
    with pytest.raises(SingletonConfigError, match="single string"):
        check_key_args(three, "a")


# --------------------------------------------------------------------------- key_fn


def test_key_fn_result_is_the_identity() -> None:
    """With key_fn the key depends only on the returned str, not on the arguments."""

    def by_account(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        return f"account:{kwargs['account']}"

    one = derive_keys(PREFIX, TASK, h, [1], {"account": 7}, key_fn=by_account)
    two = derive_keys(PREFIX, TASK, h, [2], {"account": 7}, key_fn=by_account)
    three_ = derive_keys(PREFIX, TASK, h, [1], {"account": 8}, key_fn=by_account)
    assert one == two != three_
    # a key_fn identity never equals an argument identity, even with the same text inside
    assert lock_keys(PREFIX, TASK, b"k" + canonical_encode("x")) != key_of("x")


def test_key_fn_wins_over_key_args_and_skips_binding() -> None:
    """key_fn takes precedence: key_args and the signature are not consulted."""
    result = derive_keys(PREFIX, TASK, f, [1, 2, 3], {}, key_args=["nope"], key_fn=lambda a, k: "x")
    assert result == lock_keys(PREFIX, TASK, b"k" + canonical_encode("x"))


def test_key_fn_must_return_str() -> None:
    """A key_fn returning a non-str raises SingletonKeyError."""

    def bad(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        return 42  # type: ignore[return-value]

    with pytest.raises(SingletonKeyError, match="must return a str, not int"):
        derive_keys(PREFIX, TASK, h, [1], {}, key_fn=bad)


def test_key_fn_exception_is_wrapped() -> None:
    """An exception from key_fn becomes SingletonKeyError with the original as cause."""

    def boom(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        raise KeyError("account")

    with pytest.raises(SingletonKeyError, match="raised KeyError") as info:
        derive_keys(PREFIX, TASK, h, [1], {}, key_fn=boom)
    assert isinstance(info.value.__cause__, KeyError)


# --------------------------------------------------------------------------- encoding


def test_values_of_different_types_differ() -> None:
    """1, "1", 1.0, True, b"1", Decimal(1) and an IntEnum member all give different keys."""
    values: list[object] = [1, "1", 1.0, True, b"1", decimal.Decimal(1), Level.LOW, [1], (1,)]
    assert len({canonical_encode(v) for v in values}) == len(values)
    assert len({key_of(v) for v in values}) == len(values)


def test_special_floats_and_negative_zero() -> None:
    """-0.0 differs from 0.0; nan and infinities encode deterministically."""
    assert canonical_encode(-0.0) != canonical_encode(0.0)
    assert canonical_encode(float("nan")) == canonical_encode(float("nan"))
    assert canonical_encode(float("inf")) != canonical_encode(float("-inf"))


def test_huge_int_beyond_str_digit_limit() -> None:
    """Ints too long for str() (int_max_str_digits) still encode, and distinctly."""
    big = 10**10_000
    assert canonical_encode(big) != canonical_encode(big + 1)
    assert canonical_encode(-big) != canonical_encode(big)


def test_dict_order_does_not_matter() -> None:
    """Dicts with the same items in another insertion order encode the same."""
    one = {"a": 1, "b": [1, 2], 3: "c"}
    two = {3: "c", "b": [1, 2], "a": 1}
    assert canonical_encode(one) == canonical_encode(two)
    assert key_of(one) == key_of(two)


def test_dict_keys_of_different_types_differ() -> None:
    """{1: x} and {"1": x} differ; keys may be any encodable value."""
    assert canonical_encode({1: "x"}) != canonical_encode({"1": "x"})
    assert canonical_encode({(1, "a"): None, frozenset({2}): None, None: 1})


def test_set_order_does_not_matter() -> None:
    """Sets and frozensets of equal elements encode the same whatever their iteration order."""
    words = [f"w{i}" for i in range(50)]
    assert canonical_encode(set(words)) == canonical_encode(set(reversed(words)))
    assert canonical_encode(set(words)) == canonical_encode(frozenset(words))
    assert canonical_encode({1, 2}) != canonical_encode([1, 2])


def test_concatenations_do_not_collide() -> None:
    """["ab"] differs from ["a", "b"], and similar splits differ too."""
    assert canonical_encode(["ab"]) != canonical_encode(["a", "b"])
    assert canonical_encode([["a"], "b"]) != canonical_encode([["a", "b"]])
    assert canonical_encode({"a": "bc"}) != canonical_encode({"ab": "c"})
    assert canonical_encode(("a", ("b",))) != canonical_encode((("a",), "b"))
    assert canonical_encode([b"ab"]) != canonical_encode([b"a", b"b"])


def test_list_and_tuple_differ_subclasses_encode_like_base() -> None:
    """list and tuple differ; subclasses of str/int/dict/tuple encode like their base."""
    assert canonical_encode([1, 2]) != canonical_encode((1, 2))
    assert canonical_encode(MyStr("x")) == canonical_encode("x")
    assert canonical_encode(MyInt(5)) == canonical_encode(5)
    assert canonical_encode(Point(1, 2)) == canonical_encode((1, 2))
    ordered = collections.OrderedDict([("b", 1), ("a", 2)])
    assert canonical_encode(ordered) == canonical_encode({"a": 2, "b": 1})
    assert canonical_encode(collections.defaultdict(list, {"a": [1]})) == canonical_encode(
        {"a": [1]}
    )


def test_uuid() -> None:
    """UUIDs encode by value and differ from their hex string."""
    value = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert key_of(value) == key_of(uuid.UUID(str(value)))
    assert key_of(value) != key_of(uuid.uuid4())
    assert key_of(value) != key_of(value.hex)


def test_aware_datetimes_of_one_instant_share_a_key() -> None:
    """Equal instants in two time zones give one key; naive and aware differ."""
    utc = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.timezone.utc)
    plus_two = dt.datetime(2024, 5, 1, 14, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert utc == plus_two
    assert key_of(utc) == key_of(plus_two)
    assert key_of(utc) != key_of(utc.replace(tzinfo=None))
    assert key_of(utc) != key_of(utc + dt.timedelta(microseconds=1))


def test_naive_datetime_date_time_timedelta() -> None:
    """Naive datetimes, dates, times and timedeltas encode by value and stay distinct."""
    moment = dt.datetime(2024, 5, 1, 12, 30, 15, 7)
    assert key_of(moment) == key_of(dt.datetime(2024, 5, 1, 12, 30, 15, 7))
    assert key_of(moment.date()) == key_of(dt.date(2024, 5, 1))
    assert key_of(moment.date()) != key_of(dt.datetime(2024, 5, 1))
    assert key_of(moment.time()) == key_of(dt.time(12, 30, 15, 7))
    assert key_of(dt.time(12)) != key_of(dt.time(12, tzinfo=dt.timezone.utc))
    later = dt.time(14, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert key_of(dt.time(12, tzinfo=dt.timezone.utc)) == key_of(later)
    assert key_of(dt.timedelta(days=1)) == key_of(dt.timedelta(hours=24))
    assert key_of(dt.timedelta(days=1)) != key_of(dt.timedelta(days=-1))
    assert key_of(dt.timedelta(microseconds=1)) != key_of(1)


def test_decimal_trailing_zeros_and_specials() -> None:
    """Equal Decimals encode the same; NaN and Infinity work; long values do not round."""
    dec = decimal.Decimal
    assert canonical_encode(dec("1.0")) == canonical_encode(dec("1.00")) == canonical_encode(dec(1))
    assert canonical_encode(dec("100")) == canonical_encode(dec("1E+2"))
    assert canonical_encode(dec("0.00")) == canonical_encode(dec("-0"))
    assert canonical_encode(dec("1.1")) != canonical_encode(dec("1.01"))
    long_one = dec("1." + "0" * 40 + "1")
    assert canonical_encode(long_one) != canonical_encode(dec(1))
    specials = [dec("NaN"), dec("-NaN"), dec("sNaN"), dec("Infinity"), dec("-Infinity")]
    assert len({canonical_encode(v) for v in specials}) == len(specials)


def test_bytes_like_values() -> None:
    """bytes, bytearray and memoryview with the same content encode alike but unlike str."""
    assert canonical_encode(b"abc") == canonical_encode(bytearray(b"abc"))
    assert canonical_encode(b"abc") == canonical_encode(memoryview(b"abc"))
    assert canonical_encode(b"abc") != canonical_encode("abc")
    assert canonical_encode(b"\x00\xff") != canonical_encode(b"\x00\xfe")


def test_strings_with_surrogates_and_unicode() -> None:
    """Lone surrogates encode (surrogatepass) and non-ASCII text is distinct."""
    assert canonical_encode("\ud800") != canonical_encode("\udc00")
    assert canonical_encode("é") != canonical_encode("e")


def test_enums_are_tagged_by_class_and_value() -> None:
    """Enum members differ from their value and from another enum's member with that value."""
    assert canonical_encode(Color.RED) == canonical_encode(Color(1))
    assert canonical_encode(Color.RED) != canonical_encode(Color.GREEN)
    assert canonical_encode(Color.RED) != canonical_encode(Shade.RED)
    assert canonical_encode(Color.RED) != canonical_encode(1)
    assert canonical_encode(Level.LOW) != canonical_encode(1)


def test_tuples_and_nested_dicts() -> None:
    """Nested tuples and dicts encode by value."""
    value = {"outer": {"inner": (1, ("x", None), [dt.date(2024, 1, 1)])}, "n": {"m": {}}}
    copy = {"n": {"m": {}}, "outer": {"inner": (1, ("x", None), [dt.date(2024, 1, 1)])}}
    assert key_of(value) == key_of(copy)
    copy["n"] = {"m": {"z": 1}}
    assert key_of(value) != key_of(copy)


def test_unsupported_object_names_argument_and_path() -> None:
    """An unsupported object raises SingletonKeyError naming the argument and the path."""
    with pytest.raises(SingletonKeyError) as info:
        derive_keys(PREFIX, TASK, h, [{"x": [1, 2, Foo()]}], {})
    assert str(info.value) == "cannot encode argument 'obj' at obj['x'][2]: unsupported type Foo"

    class Odd(enum.Enum):
        """An enum whose value cannot be encoded."""

        ONE = Foo()

    with pytest.raises(SingletonKeyError, match=r"argument 'extra' at extra\['k'\]\.value"):
        derive_keys(PREFIX, TASK, g, [1], {"k": Odd.ONE})
    with pytest.raises(SingletonKeyError, match=r"argument 'value' at value\[<element>\]"):
        canonical_encode({Foo()})
    with pytest.raises(SingletonKeyError, match=r"argument 'value' at value\[<key>\]"):
        canonical_encode({Foo(): 1})
    with pytest.raises(SingletonKeyError, match=r"argument 'rest' at rest\[1\]: unsupported type"):
        derive_keys(PREFIX, TASK, g, [1, 2, object()], {})


def test_reference_cycle_raises_key_error() -> None:
    """A list or dict containing itself raises SingletonKeyError instead of recursing forever."""
    loop: list[object] = [1]
    loop.append(loop)
    with pytest.raises(SingletonKeyError, match=r"at obj\[1\]: contains a reference cycle"):
        key_of(loop)
    table: dict[str, object] = {}
    table["self"] = table
    with pytest.raises(SingletonKeyError, match="reference cycle"):
        canonical_encode(table)


def test_shared_references_are_not_cycles() -> None:
    """The same list appearing twice is fine."""
    shared = [1, 2]
    assert canonical_encode([shared, shared]) == canonical_encode([[1, 2], [1, 2]])


def test_deep_nesting_raises_key_error() -> None:
    """A list nested 10_000 deep raises SingletonKeyError ("nested too deeply")."""
    value: list[Any] = []
    for _ in range(10_000):
        value = [value]
    with pytest.raises(SingletonKeyError, match="nested too deeply") as info:
        key_of(value)
    assert len(str(info.value)) < 500
    nested: dict[str, Any] = {}
    for _ in range(10_000):
        nested = {"k": nested}
    with pytest.raises(SingletonKeyError, match="nested too deeply"):
        canonical_encode(nested)
    shallow: list[Any] = []
    for _ in range(encoding.MAX_DEPTH - 1):
        shallow = [shallow]
    assert canonical_encode(shallow)


def test_recursion_limit_becomes_key_error() -> None:
    """Hitting the interpreter's recursion limit below MAX_DEPTH still gives SingletonKeyError."""
    frame = sys._getframe()
    depth = 0
    while frame is not None:
        depth += 1
        frame = frame.f_back  # type: ignore[assignment]
    value: list[Any] = []
    for _ in range(encoding.MAX_DEPTH - 10):
        value = [value]
    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 60)
    try:
        with pytest.raises(SingletonKeyError, match="nested too deeply"):
            canonical_encode(value)
    finally:
        sys.setrecursionlimit(old_limit)


def test_huge_arguments_are_fine() -> None:
    """A 1 MB string and a 1 MB bytes value encode and hash."""
    text = "x" * 1_000_000
    found = key_of(text)
    assert found == key_of("x" * 1_000_000)
    assert found != key_of(text + "y")
    assert key_of(b"\0" * 1_000_000) != found


# --------------------------------------------------------------------------- key names


def test_key_shape_and_hash_tag() -> None:
    """Both keys share the {name:digest} hash tag behind the prefix."""
    identity = b"a" + canonical_encode({"a": 1, "full": False})
    found = derive_keys(PREFIX, TASK, f, [1], {})
    digest = argument_digest(TASK, identity)
    assert re.fullmatch(r"[0-9a-f]{32}", digest)
    assert found == lock_keys(PREFIX, TASK, identity)
    assert found.lock == f"test:{{app.tasks.sync:{digest}}}:lock"
    assert found.fence == f"test:{{app.tasks.sync:{digest}}}:fence"
    assert hash_tag(found.lock) == hash_tag(found.fence) == f"app.tasks.sync:{digest}"


def test_digest_covers_task_name_and_identity() -> None:
    """Different task names or identities give different digests, even with equal safe names."""
    assert argument_digest("a.b", b"x") != argument_digest("a.b", b"y")
    assert argument_digest("a b", b"x") != argument_digest("a_b", b"x")
    assert safe_name("a b") == safe_name("a_b")


def found_identity() -> bytes:
    """Identity of f(1)."""
    return b"a" + canonical_encode({"a": 1, "full": False})


@pytest.mark.parametrize(
    "task_name",
    ["a*b?[c]{d} e\\f", "x" * 1000, "tâche.ünïcode", "tab\tnew\nline\r", "", "}{", "\ud800"],
)
def test_hostile_task_names_give_safe_keys(task_name: str) -> None:
    """Keys stay short and free of glob, brace and whitespace characters for any task name."""
    found = derive_keys(PREFIX, task_name, f, [1], {})
    for key in (found.lock, found.fence):
        assert len(key) <= len(PREFIX) + MAX_NAME_CHARS + 45
        assert not set("*?[]\\") & set(key)
        assert not any(char.isspace() for char in key)
        assert key.count("{") == key.count("}") == 1
        assert hash_tag(key).endswith(":" + argument_digest(task_name, found_identity()))
    assert hash_tag(found.lock) == hash_tag(found.fence)


def test_safe_name() -> None:
    """safe_name keeps [A-Za-z0-9_.-], replaces anything else and cuts to MAX_NAME_CHARS."""
    assert safe_name("a*b?[c]{d} e\\f") == "a_b__c__d__e_f"
    assert safe_name("App.tasks-v2_x") == "App.tasks-v2_x"
    assert safe_name("é") == "_"
    assert safe_name("y" * 500) == "y" * MAX_NAME_CHARS


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "x" * 65,
        "a{",
        "a}",
        "a*",
        "a?",
        "a[",
        "a]",
        "a\\",
        "a b",
        "a\t",
        "a\n",
        "a\x00",
        "a\x7f",
        "a\u00a0",
        "a\u200b",
    ],
)
def test_check_prefix_rejects_bad_prefixes(prefix: str) -> None:
    """check_prefix rejects empty, too long, glob/brace, whitespace and control characters."""
    with pytest.raises(SingletonConfigError):
        check_prefix(prefix)


def test_check_prefix_rejects_non_str_and_accepts_good_prefixes() -> None:
    """check_prefix rejects non-str values and accepts ordinary prefixes."""
    with pytest.raises(SingletonConfigError, match="must be a str"):
        check_prefix(b"x:")  # type: ignore[arg-type]
    for prefix in ["singleton:", "x" * 64, "app.v1-lock:", "é:", "a/b|c"]:
        check_prefix(prefix)


@given(st.text(max_size=300), st.binary(max_size=50), st.sampled_from(["singleton:", "é:", "a"]))
@example("", b"", "singleton:")
@example("x" * 1000, b"a", "singleton:")
def test_every_lock_key_is_a_lock_key_and_its_neighbours_are_not(
    task_name: str, identity: bytes, prefix: str
) -> None:
    """lock_key_problem accepts what lock_keys (and leader_keys) write, and nothing beside it:
    not the fence, the queued marker, a beat claim, the key under another prefix."""
    found = lock_keys(prefix, task_name, identity)
    assert lock_key_problem(prefix, found.lock) is None
    assert lock_key_problem(prefix, leader_keys(prefix, task_name).lock) is None
    for other in (found.fence, queued_key(found.lock), run_claim_key(prefix, task_name, "1")):
        assert lock_key_problem(prefix, other) == (
            f"not a lock key of this library (those read {prefix}{{<task name>:<32 hex digits>}}"
            ":lock)"
        )
    for outside in (f"x{found.lock}", found.lock[len(prefix) :]):
        assert lock_key_problem(prefix, outside) == f"outside the prefix {prefix!r}"
    assert lock_key_problem(prefix + "x", found.lock) is not None


def test_keys_module_imports_neither_celery_nor_redis() -> None:
    """keys.py, encoding.py and arguments.py stay pure: no celery or redis import in them."""
    imported: set[str] = set()
    for module in (keys, encoding, arguments):
        tree = ast.parse(Path(module.__file__ or "").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    assert not imported & {"celery", "kombu", "billiard", "redis"}


# --------------------------------------------------------------------------- properties

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.text()
    | st.binary()
    | st.uuids()
    | st.datetimes()
    | st.datetimes(
        min_value=dt.datetime(2, 1, 1),
        max_value=dt.datetime(9998, 12, 31),
        timezones=st.integers(-1439, 1439).map(lambda m: dt.timezone(dt.timedelta(minutes=m))),
    )
    | st.dates()
    | st.times()
    | st.timedeltas()
    | st.decimals(allow_nan=False)
)
hashables = st.recursive(
    scalars, lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=4), max_leaves=8
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(hashables, inner, max_size=4)
        | st.frozensets(hashables, max_size=4)
    ),
    max_leaves=20,
)


@given(values)
def test_encoding_is_deterministic(value: object) -> None:
    """Encoding a value twice gives the same bytes and the same key."""
    assert canonical_encode(value) == canonical_encode(value)
    assert key_of(value) == key_of(value)


@given(st.dictionaries(hashables, scalars | st.lists(scalars, max_size=3), max_size=8), st.data())
def test_dict_permutations_encode_equal(value: dict[Any, Any], data: st.DataObject) -> None:
    """A dict rebuilt in another insertion order encodes the same."""
    items = data.draw(st.permutations(list(value.items())))
    assert canonical_encode(dict(items)) == canonical_encode(value)


@given(st.lists(st.text(max_size=3), max_size=5), st.lists(st.text(max_size=3), max_size=5))
def test_lists_of_strings_collide_only_when_equal(one: list[str], two: list[str]) -> None:
    """Two lists of strings encode the same exactly when they are equal."""
    assert (canonical_encode(one) == canonical_encode(two)) == (one == two)


@given(st.integers(), st.integers())
def test_ints_collide_only_when_equal(one: int, two: int) -> None:
    """Two ints encode the same exactly when they are equal."""
    assert (canonical_encode(one) == canonical_encode(two)) == (one == two)


@given(st.decimals(allow_nan=False, allow_infinity=False), st.integers(min_value=0, max_value=5))
def test_decimal_with_extra_trailing_zeros_encodes_equal(
    value: decimal.Decimal, zeros: int
) -> None:
    """A Decimal quantized with more trailing zeros (same value) encodes the same."""
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    padded = decimal.Decimal((sign, (*digits, *([0] * zeros)), exponent - zeros))
    assert padded == value
    assert canonical_encode(padded) == canonical_encode(value)


# --------------------------------------------------------------------------- hash seed

SEED_SCRIPT = """
import datetime, decimal, uuid
from celery_singleton_lock.core.keys import derive_keys

def task(payload, tags, *rest, **extra):
    pass

payload = {
    "names": frozenset({"alpha", "beta", "gamma", "delta", "epsilon", "zeta"}),
    "nested": {"b": [1, 2.5, None], "a": {"x": (b"raw", True)}, 3: {"k", "l", "m"}},
    "when": datetime.datetime(2024, 5, 1, 12, tzinfo=datetime.timezone.utc),
    "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "amount": decimal.Decimal("10.50"),
}
keys = derive_keys("seed:", "app.seed", task, [payload, {"t1", "t2", "t3"}, 7], {"z": 1, "y": 2})
print(keys.lock)
"""


def test_key_does_not_depend_on_hash_seed() -> None:
    """The same call gives the same key here and in subprocesses with other PYTHONHASHSEEDs."""
    namespace: dict[str, Any] = {}
    exec(SEED_SCRIPT.replace("print(keys.lock)", ""), namespace)
    local = namespace["keys"].lock
    for seed in ("123", "0"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", SEED_SCRIPT],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert result.stdout.strip() == local


def test_args_preview_is_short_and_never_raises() -> None:
    """The preview is a cut repr of the call; a broken __repr__ does not break it."""
    from celery_singleton_lock.core.arguments import MAX_PREVIEW_CHARS, args_preview

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert args_preview((42,), {"full": True}) == "(42,) {'full': True}"
    long = args_preview(("x" * 1000, list(range(1000))), {f"k{i}": i for i in range(100)})
    assert len(long) <= MAX_PREVIEW_CHARS
    assert long.startswith("('xxxx")
    assert "Broken" in args_preview((Broken(),), {})


def test_args_preview_shows_the_callers_argsrepr_and_kwargsrepr() -> None:
    """A half the caller has Celery show (``argsrepr``/``kwargsrepr``) is shown as given and
    never from the arguments; a half not given (None, empty) is previewed; the whole is cut."""
    from celery_singleton_lock.core.arguments import MAX_PREVIEW_CHARS, args_preview

    card = "4111111111111111"
    assert args_preview((card,), {}, "('****',)") == "('****',) {}"
    assert args_preview((card,), {"n": 1}, "('****',)", None) == "('****',) {'n': 1}"
    assert args_preview((1,), {"card": card}, "", "{'card': '*'}") == "(1,) {'card': '*'}"
    assert args_preview((card,), {"card": card}, "(*,)", "{*}") == "(*,) {*}"
    assert args_preview((card,), {}, None, None) == f"('{card}',) {{}}"
    long = args_preview((card,), {}, "x" * 1000)
    assert len(long) == MAX_PREVIEW_CHARS
    assert card not in long


# --------------------------------------------------------------------------- fast paths

_KINDS = (
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.KEYWORD_ONLY,
    inspect.Parameter.VAR_POSITIONAL,
    inspect.Parameter.VAR_KEYWORD,
)


@st.composite
def signatures(draw: st.DrawFn) -> inspect.Signature:
    """Valid signatures of up to five parameters; half of them positional-or-keyword only."""
    any_kind = st.sampled_from(_KINDS) if draw(st.booleans()) else st.just(_KINDS[0])
    kinds = sorted(draw(st.lists(any_kind, max_size=5)))
    parameters: list[inspect.Parameter] = []
    seen_default = False
    for index, kind in enumerate(kinds):
        if kind in {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} and any(
            p.kind is kind for p in parameters
        ):
            continue
        default: Any = inspect.Parameter.empty
        positional = kind in {
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        }
        if kind not in {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} and (
            (positional and seen_default) or draw(st.booleans())
        ):
            default = draw(st.integers(-3, 3) | st.none())
            seen_default = seen_default or positional
        parameters.append(inspect.Parameter(f"p{index}", kind, default=default))
    return inspect.Signature(parameters)


@given(
    signatures(),
    st.lists(st.integers(-5, 5), max_size=6),
    st.dictionaries(
        st.sampled_from(["p0", "p1", "p2", "p3", "p4", "zz"]), st.integers(), max_size=4
    ),
)
def test_binding_matches_signature_bind(
    signature: inspect.Signature, args: list[int], kwargs: dict[str, int]
) -> None:
    """Every call binds exactly as Signature.bind + apply_defaults: values, order and errors."""

    def task(*a: Any, **k: Any) -> None:
        """Takes anything; its signature is set below."""

    task.__signature__ = signature  # type: ignore[attr-defined]
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        error = str(exc)
    else:
        error = ""
    if error:
        with pytest.raises(SingletonKeyError) as info:
            bind_arguments(task, args, kwargs)
        assert error in str(info.value)
        return
    bound.apply_defaults()
    assert list(bind_arguments(task, args, kwargs).items()) == list(bound.arguments.items())
    assert list(bind_arguments(task, tuple(args), kwargs).items()) == list(bound.arguments.items())


@given(
    signatures(),
    st.lists(
        st.integers(-5, 5) | st.text(max_size=3) | st.lists(st.none(), max_size=2), max_size=6
    ),
    st.dictionaries(
        st.sampled_from(["p0", "p1", "p2", "p3", "p4", "zz"]), st.integers(), max_size=4
    ),
    st.data(),
)
def test_key_deriver_gives_the_key_of_the_bound_arguments(
    signature: inspect.Signature, args: list[Any], kwargs: dict[str, int], data: st.DataObject
) -> None:
    """A task's KeyDeriver (names encoded and sorted once, positional calls unbound) gives
    the key of its bound arguments' canonical encoding, and the same errors, for every call."""

    def task(*a: Any, **k: Any) -> None:
        """Takes anything; its signature is set below."""

    task.__signature__ = signature  # type: ignore[attr-defined]
    names = list(signature.parameters)
    key_args = data.draw(
        st.none() | st.lists(st.sampled_from(names), max_size=4) if names else st.none()
    )
    deriver = keys.KeyDeriver("p:", "t", task, key_args, None, 3)
    try:
        identity = b"a" + canonical_encode(bind_arguments(task, args, kwargs, key_args))
    except SingletonKeyError as exc:
        error = str(exc)
    else:
        error = ""
    if error:
        with pytest.raises(SingletonKeyError) as info:
            deriver.derive(args, kwargs)
        assert str(info.value) == error
        return
    expected = lock_keys("p:", "t", identity).with_permits(3)
    assert deriver.derive(args, kwargs) == expected
    assert deriver.derive(tuple(args), kwargs) == expected
    assert derive_keys("p:", "t", task, args, kwargs, key_args).with_permits(3) == expected


def test_key_deriver_names_the_argument_it_cannot_encode() -> None:
    """A call given by position that cannot be encoded names its argument, as a bound one."""
    deriver = keys.KeyDeriver("p:", "t", _sync)
    for args, kwargs in (((object(), True), {}), ((object(),), {"full": True})):
        with pytest.raises(SingletonKeyError, match="argument 'account_id' at account_id"):
            deriver.derive(args, kwargs)


_plain = (
    st.integers()
    | st.integers(10**21, 10**26).filter(lambda n: n > 10**23)  # around where reprlib shortens
    | st.floats()
    | st.text(max_size=30)
    | st.text(alphabet="ab'\"", min_size=20, max_size=26)
    | st.booleans()
    | st.none()
    | st.builds(decimal.Decimal, st.integers())  # not plain: goes through reprlib
)


@given(
    st.lists(_plain, max_size=6),
    st.dictionaries(
        st.text(max_size=25) | st.text("ab", min_size=20, max_size=26), _plain, max_size=6
    ),
)
@example(["x" * 22, 10**23], {"k" * 22: "v" * 22})  # the longest shown whole
@example(["x" * 23], {})  # one more: shortened
@example([10**24], {})
@example([], {"k" * 23: 1})
@example([], {"k": "v" * 23})
def test_args_preview_matches_reprlib(args: list[Any], kwargs: dict[str, Any]) -> None:
    """The preview of scalars built without reprlib is exactly reprlib's, cut alike."""
    from celery_singleton_lock.core.arguments import MAX_PREVIEW_CHARS, args_preview

    expected = f"{arguments._preview.repr(tuple(args))} {arguments._preview.repr(dict(kwargs))}"
    if len(expected) > MAX_PREVIEW_CHARS:
        expected = expected[: MAX_PREVIEW_CHARS - 3] + "..."
    assert args_preview(args, kwargs) == expected


def _sync(account_id: Any, full: bool = False) -> None:
    """A task body for the pinned keys."""


def _many(a: Any, b: Any = 2, *rest: Any, c: Any = None, **kw: Any) -> None:
    """A task body with every kind of parameter, for the pinned keys."""


@pytest.mark.parametrize(
    ("func", "args", "kwargs", "digest"),
    [
        (_sync, [42], {}, "aa2ab49a3dda91f55efc6917a52ce6d8"),
        (_sync, [], {"account_id": 42}, "aa2ab49a3dda91f55efc6917a52ce6d8"),
        (_sync, [42, True], {}, "9b958339e9e3c1570dc3c45d5e1d4daf"),
        (_sync, ["42"], {}, "54e3df506364a8f7cb6df6dc78186572"),
        (_sync, [-7], {"full": True}, "1f6480bc66281f46c35ed2a8675738bc"),
        (_sync, ["grüße"], {}, "85c86a8612b5f88a73b3657cd9bad975"),
        (_many, [1, 2, 3], {"c": None, "x": [1, "a"]}, "61f687ab91d2ad18b09322e8edf021a6"),
        (_many, [{"k": (1, 2.5)}], {}, "4e02700d60d23c6e128e106a7011c1c1"),
        (
            _many,
            [uuid.UUID(int=1), decimal.Decimal("1.50"), dt.date(2024, 1, 2)],
            {},
            "823d3d7a356cdd4828c70f852979ea64",
        ),
    ],
)
def test_keys_are_pinned(func: Any, args: list[Any], kwargs: dict[str, Any], digest: str) -> None:
    """Keys never change between releases: workers of two versions must find each other's locks."""
    name = f"proj.tasks.{func.__name__.lstrip('_')}"
    expected = f"app:{{{name}:{digest}}}:lock"
    assert derive_keys("app:", name, func, args, kwargs).lock == expected
