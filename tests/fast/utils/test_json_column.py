"""A JSON column round-trips values of any length, any subset of its rows, and refuses what is not one."""

import pytest
import torch

from miles.utils.json_column import decode_json_column, encode_json_column


def test_values_round_trip_through_rows_of_any_subset():
    values = [{"color": "red", "count": 2}, {"prompt": "ünïcode ✓", "nested": [1, 2.5, None]}, {}]
    column = encode_json_column(values)
    assert column.dtype == torch.uint8 and column.shape[0] == 3
    assert decode_json_column(column) == values
    assert decode_json_column(column[[2, 0]]) == [values[2], values[0]]
    assert decode_json_column(encode_json_column([])) == []


def test_a_column_of_another_dtype_is_refused():
    with pytest.raises(ValueError, match="uint8"):
        decode_json_column(torch.zeros(2, 3))


def test_a_fake_column_decodes_to_the_stand_in_row_and_only_inside_its_context():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from miles.utils.json_column import fake_rows_decode_as

    with FakeTensorMode(allow_non_fake_inputs=True):
        column = encode_json_column([{"color": "red"}, {"color": "blue"}])[:1]  # the planner's: no bytes
        with pytest.raises(ValueError, match="a fake JSON column holds no bytes"):
            decode_json_column(column)
        with fake_rows_decode_as({"color": "green", "prompt": "p"}):
            rows = decode_json_column(column)
    assert rows == [{"color": "green", "prompt": "p"}]
    rows[0]["color"] = "changed"  # each row its own copy
    with fake_rows_decode_as({"color": "green"}):
        assert decode_json_column(encode_json_column([{"color": "red"}])) == [{"color": "red"}]  # real: its bytes
