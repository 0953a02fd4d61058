// A JSON reader with CPython's json module semantics (C scanner, strict=True), so that records
// parse to the same values and malformed files fail with the same message, line and column as
// ort_trainer/data.py: "Expecting value", "Expecting ',' delimiter", "Unterminated string
// starting at", ... Values: str -> string, int -> PyInt, float (and NaN/Infinity, which Python
// accepts) -> PyFloat, true/false -> boolean, null -> null, list -> Array, object -> an object
// without prototype (so keys like "__proto__" are plain keys; duplicate keys: the last wins).

import { PyFloat, PyInt, cpLength } from "./pystr.mjs";

export class JSONDecodeError extends Error {
  /** pos is a UTF-16 index into doc; lineno/colno count code points like Python. */
  constructor(msg, doc, pos) {
    const lineStart = doc.lastIndexOf("\n", pos - 1) + 1;
    const lineno = countNewlines(doc, 0, pos) + 1;
    const colno = cpLength(doc.slice(lineStart, pos)) + 1;
    super(`${msg}: line ${lineno} column ${colno}`);
    this.name = "JSONDecodeError";
    this.msg = msg;
    this.pos = pos;
    this.lineno = lineno;
    this.colno = colno;
  }
}

function countNewlines(s, from, to) {
  let n = 0;
  for (let i = s.indexOf("\n", from); i !== -1 && i < to; i = s.indexOf("\n", i + 1)) n++;
  return n;
}

class StopIteration {
  constructor(value) { this.value = value; }
}

const isWs = (c) => c === " " || c === "\t" || c === "\n" || c === "\r";
const isDigit = (c) => c >= "0" && c <= "9";

/** Index of the first non-JSON-whitespace character at or after i. */
export function skipWs(s, i) {
  while (i < s.length && isWs(s[i])) i++;
  return i;
}

const ESCAPES = { '"': '"', "\\": "\\", "/": "/", b: "\b", f: "\f", n: "\n", r: "\r", t: "\t" };

function decodeUXXXX(s, pos) {
  // pos points at the 'u'
  const esc = s.slice(pos + 1, pos + 5);
  if (esc.length === 4 && /^[0-9a-fA-F]{4}$/.test(esc)) return parseInt(esc, 16);
  throw new JSONDecodeError("Invalid \\uXXXX escape", s, pos);
}

function scanString(s, end) {
  // end: index after the opening quote
  const begin = end - 1;
  let out = "";
  for (;;) {
    let j = end;
    while (j < s.length) {
      const c = s.charCodeAt(j);
      if (c === 0x22 || c === 0x5c || c < 0x20) break;
      j++;
    }
    if (j >= s.length) throw new JSONDecodeError("Unterminated string starting at", s, begin);
    out += s.slice(end, j);
    const term = s[j];
    end = j + 1;
    if (term === '"') break;
    if (term !== "\\") throw new JSONDecodeError("Invalid control character at", s, j);
    if (end >= s.length) throw new JSONDecodeError("Unterminated string starting at", s, begin);
    const esc = s[end];
    if (esc !== "u") {
      if (!(esc in ESCAPES)) throw new JSONDecodeError("Invalid \\escape", s, end - 1);
      out += ESCAPES[esc];
      end += 1;
    } else {
      let uni = decodeUXXXX(s, end);
      end += 5;
      if (uni >= 0xd800 && uni <= 0xdbff && s.slice(end, end + 2) === "\\u") {
        const uni2 = decodeUXXXX(s, end + 1);
        if (uni2 >= 0xdc00 && uni2 <= 0xdfff) {
          uni = 0x10000 + (((uni - 0xd800) << 10) | (uni2 - 0xdc00));
          end += 6;
        }
      }
      out += String.fromCodePoint(uni);
    }
  }
  return [out, end];
}

function scanOnce(s, idx) {
  if (idx >= s.length) throw new StopIteration(idx);
  const c = s[idx];
  if (c === '"') return scanString(s, idx + 1);
  if (c === "{") return parseObject(s, idx + 1);
  if (c === "[") return parseArray(s, idx + 1);
  if (c === "n" && s.startsWith("null", idx)) return [null, idx + 4];
  if (c === "t" && s.startsWith("true", idx)) return [true, idx + 4];
  if (c === "f" && s.startsWith("false", idx)) return [false, idx + 5];
  if (c === "N" && s.startsWith("NaN", idx)) return [new PyFloat(NaN), idx + 3];
  if (c === "I" && s.startsWith("Infinity", idx)) return [new PyFloat(Infinity), idx + 8];
  if (c === "-" && s.startsWith("-Infinity", idx)) return [new PyFloat(-Infinity), idx + 9];
  return matchNumber(s, idx);
}

function matchNumber(s, start) {
  let idx = start;
  const n = s.length;
  if (s[idx] === "-") {
    idx++;
    if (idx >= n) throw new StopIteration(start);
  }
  if (s[idx] >= "1" && s[idx] <= "9") {
    idx++;
    while (idx < n && isDigit(s[idx])) idx++;
  } else if (s[idx] === "0") {
    idx++;
  } else {
    throw new StopIteration(start);
  }
  let isFloat = false;
  if (idx + 1 < n && s[idx] === "." && isDigit(s[idx + 1])) {
    isFloat = true;
    idx += 2;
    while (idx < n && isDigit(s[idx])) idx++;
  }
  if (idx + 1 < n && (s[idx] === "e" || s[idx] === "E")) {
    const eStart = idx;
    idx++;
    if (idx + 1 < n && (s[idx] === "-" || s[idx] === "+")) idx++;
    while (idx < n && isDigit(s[idx])) idx++;
    if (isDigit(s[idx - 1])) isFloat = true;
    else idx = eStart;
  }
  const text = s.slice(start, idx);
  return [isFloat ? new PyFloat(Number(text)) : new PyInt(text), idx];
}

function scanValue(s, idx) {
  try {
    return scanOnce(s, idx);
  } catch (e) {
    if (e instanceof StopIteration) throw new JSONDecodeError("Expecting value", s, e.value);
    throw e;
  }
}

function parseObject(s, end) {
  const obj = Object.create(null);
  let next = s[end];
  if (next !== '"') {
    if (next !== undefined && isWs(next)) {
      end = skipWs(s, end);
      next = s[end];
    }
    if (next === "}") return [obj, end + 1];
    if (next !== '"') throw new JSONDecodeError("Expecting property name enclosed in double quotes", s, end);
  }
  end += 1;
  for (;;) {
    let key;
    [key, end] = scanString(s, end);
    if (s[end] !== ":") {
      end = skipWs(s, end);
      if (s[end] !== ":") throw new JSONDecodeError("Expecting ':' delimiter", s, end);
    }
    end = skipWs(s, end + 1);
    let value;
    [value, end] = scanValue(s, end);
    obj[key] = value;
    end = skipWs(s, end);
    const c = s[end];
    end += 1;
    if (c === "}") break;
    if (c !== ",") throw new JSONDecodeError("Expecting ',' delimiter", s, end - 1);
    end = skipWs(s, end);
    const q = s[end];
    end += 1;
    if (q !== '"') throw new JSONDecodeError("Expecting property name enclosed in double quotes", s, end - 1);
  }
  return [obj, end];
}

function parseArray(s, end) {
  const values = [];
  end = skipWs(s, end);
  if (s[end] === "]") return [values, end + 1];
  for (;;) {
    let value;
    [value, end] = scanValue(s, end);
    values.push(value);
    end = skipWs(s, end);
    const c = s[end];
    end += 1;
    if (c === "]") break;
    if (c !== ",") throw new JSONDecodeError("Expecting ',' delimiter", s, end - 1);
    end = skipWs(s, end);
  }
  return [values, end];
}

/** json.JSONDecoder().raw_decode(s, idx): [value, end]. */
export function rawDecode(s, idx = 0) {
  return scanValue(s, idx);
}

/** json.loads(s) for a str. */
export function loads(s) {
  if (s.startsWith("\ufeff")) throw new JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", s, 0);
  const [obj, end0] = rawDecode(s, skipWs(s, 0));
  const end = skipWs(s, end0);
  if (end !== s.length) throw new JSONDecodeError("Extra data", s, end);
  return obj;
}
