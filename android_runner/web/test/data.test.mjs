// JS-only checks of src/data (node --test). The full parity with the Python side on the shared
// corpora is tests/test_web_data.py; the expected values here were produced by numpy / CPython.
import assert from "node:assert/strict";
import test from "node:test";
import { DataError, DataOrder, alpacaPrompt, collate, defaultRng } from "../src/data/index.mjs";
import { loads } from "../src/data/pyjson.mjs";
import { floatRepr, pyRepr, splitlines } from "../src/data/pystr.mjs";
import { findUtf8Error } from "../src/data/utf8.mjs";

test("numpy default_rng([seed, epoch]).permutation is reproduced bit-exactly", () => {
  const g = defaultRng([0, 0]);
  assert.deepEqual(Array.from(g.permutation(10)), [4, 6, 2, 7, 3, 5, 9, 0, 8, 1]);
  assert.deepEqual(Array.from(g.permutation(5)), [0, 2, 3, 4, 1]);   // same generator continues
  assert.deepEqual(Array.from(defaultRng([2n ** 40n + 3n, 7]).permutation(20)),
    [16, 7, 13, 6, 10, 12, 15, 14, 0, 1, 17, 3, 5, 9, 19, 11, 18, 4, 8, 2]);
});

test("DataOrder with group_by_length, state save and restore", () => {
  const lengths = [5, 1, 9, 2, 8, 3, 7, 4, 6, 0];
  const o = new DataOrder(10, 5, 3, lengths);
  const seq = Array.from({ length: 7 }, () => o.nextBatch());
  assert.deepEqual(seq, [[[8, 0, 7], 0], [[2, 4, 6], 0], [[5, 3, 1], 0], [[2, 4, 6], 1], [[5, 3, 1], 1],
    [[8, 0, 7], 1], [[2, 4, 6], 2]]);
  const a = new DataOrder(10, 5, 3, lengths);
  a.nextBatch();
  const state = JSON.parse(JSON.stringify(a.stateDict()));
  const b = new DataOrder(10, 5, 3, lengths);
  b.loadStateDict(state);
  assert.deepEqual(b.nextBatch(), seq[1]);
  assert.throws(() => new DataOrder(10, 6, 3, lengths).loadStateDict(state), DataError);
  assert.throws(() => new DataOrder(0, 1, 1), /DataOrder: no examples \(n=0\)/);
});

test("collate right-pads to int64 tensors", () => {
  const b = collate([{ input_ids: [1, 2, 3], labels: [-100, 2, 3] }, { input_ids: [4], labels: [4] }], 9);
  assert.deepEqual(b.dims, [2, 3]);
  assert.deepEqual(Array.from(b.input_ids, Number), [1, 2, 3, 4, 9, 9]);
  assert.deepEqual(Array.from(b.attention_mask, Number), [1, 1, 1, 1, 0, 0]);
  assert.deepEqual(Array.from(b.labels, Number), [-100, 2, 3, 4, -100, -100]);
});

test("Python json / str / codec semantics", () => {
  const msg = (s) => { try { loads(s); return null; } catch (e) { return [e.msg, e.lineno, e.colno]; } };
  assert.deepEqual(msg('{"a":1,}'), ["Expecting property name enclosed in double quotes", 1, 8]);
  assert.deepEqual(msg('[1 2]'), ["Expecting ',' delimiter", 1, 4]);
  assert.deepEqual(msg('"\\ud800\\u12"'), ["Invalid \\uXXXX escape", 1, 9]);
  assert.deepEqual(msg('01'), ["Extra data", 1, 2]);
  assert.equal(pyRepr(loads('[1, 1.0, 1e16, null, true, "it\'s"]')), `[1, 1.0, 1e+16, None, True, "it's"]`);
  assert.equal(floatRepr(1e-5), "1e-05");
  assert.deepEqual(splitlines("a\x1cb\u2028c\r\nd"), ["a", "b", "c", "d"]);
  assert.deepEqual(findUtf8Error(Uint8Array.from([0x61, 0xe2, 0x82])), ["unexpected end of data", 1]);
  assert.deepEqual(findUtf8Error(Uint8Array.from([0xed, 0xa0, 0x80])), ["invalid continuation byte", 0]);
  assert.equal(alpacaPrompt("{input}", "x").includes("### Instruction:\n{input}\n\n### Input:\nx"), true);
});
