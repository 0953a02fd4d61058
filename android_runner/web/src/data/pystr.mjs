// Python string semantics the data pipeline depends on (ort_trainer/data.py runs on CPython):
// str.isspace / str.strip, str.splitlines, repr(), type(x).__name__ and code-point ordering.
// JavaScript's trim(), split(/\r?\n/) and default sort differ from them on a few characters,
// which would change line counts, blank-line decisions and error messages.

/** Code points CPython's str.isspace() accepts (Unicode White_Space, bidi B/S/WS, Zs). */
const PY_SPACE = new Set([
  0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680,
  0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a,
  0x2028, 0x2029, 0x202f, 0x205f, 0x3000,
]);

export function isPySpace(ch) {
  return PY_SPACE.has(ch.codePointAt(0));
}

/** `not s.strip()` in Python: empty or only Python whitespace. */
export function isBlank(s) {
  for (let i = 0; i < s.length; i++) {
    if (!PY_SPACE.has(s.charCodeAt(i))) return false;
  }
  return true;
}

/** Python str.splitlines boundaries (after \r\n as one). */
const LINE_BREAKS = new Set([0x0a, 0x0b, 0x0c, 0x0d, 0x1c, 0x1d, 0x1e, 0x85, 0x2028, 0x2029]);

/** Python `s.splitlines(keepends)`. */
export function splitlines(s, keepends = false) {
  const out = [];
  const n = s.length;
  let start = 0;
  let i = 0;
  while (i < n) {
    const c = s.charCodeAt(i);
    if (LINE_BREAKS.has(c)) {
      let eol = i + 1;
      if (c === 0x0d && i + 1 < n && s.charCodeAt(i + 1) === 0x0a) eol = i + 2;
      out.push(s.slice(start, keepends ? eol : i));
      start = eol;
      i = eol;
    } else {
      i++;
    }
  }
  if (start < n) out.push(s.slice(start));
  return out;
}

/** Number of code points (Python len) of a JS (UTF-16) string. */
export function cpLength(s) {
  let n = 0;
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c >= 0xd800 && c <= 0xdbff && i + 1 < s.length) {
      const d = s.charCodeAt(i + 1);
      if (d >= 0xdc00 && d <= 0xdfff) i++;
    }
    n++;
  }
  return n;
}

/** Compare strings by code point, like Python's sorted() on str. */
export function cmpCodePoints(a, b) {
  const ia = a[Symbol.iterator]();
  const ib = b[Symbol.iterator]();
  for (;;) {
    const x = ia.next();
    const y = ib.next();
    if (x.done || y.done) return (x.done ? 0 : 1) - (y.done ? 0 : 1);
    const cx = x.value.codePointAt(0);
    const cy = y.value.codePointAt(0);
    if (cx !== cy) return cx < cy ? -1 : 1;
  }
}

// Values parsed by pyjson.mjs keep Python's int/float distinction for messages.
export class PyInt {
  constructor(text) { this.text = text === "-0" ? "0" : text; }
  valueOf() { return Number(this.text); }
  toString() { return this.text; }
}

export class PyFloat {
  constructor(value) { this.value = value; }
  valueOf() { return this.value; }
  toString() { return floatRepr(this.value); }
}

export function isDict(v) {
  if (v === null || typeof v !== "object" || Array.isArray(v)) return false;
  if (v instanceof PyInt || v instanceof PyFloat) return false;
  const proto = Object.getPrototypeOf(v);
  return proto === null || proto === Object.prototype;
}

/** Python's type(x).__name__ for a JSON value. */
export function typeName(v) {
  if (v === null || v === undefined) return "NoneType";
  if (typeof v === "string") return "str";
  if (typeof v === "boolean") return "bool";
  if (v instanceof PyInt || typeof v === "bigint") return "int";
  if (v instanceof PyFloat) return "float";
  if (typeof v === "number") return Number.isInteger(v) ? "int" : "float";
  if (Array.isArray(v)) return "list";
  return "dict";
}

/** Python repr(float): shortest round-trip digits, exponent form outside [1e-4, 1e16). */
export function floatRepr(x) {
  if (Number.isNaN(x)) return "nan";
  if (x === Infinity) return "inf";
  if (x === -Infinity) return "-inf";
  if (x === 0) return Object.is(x, -0) ? "-0.0" : "0.0";
  const [mant, expStr] = x.toExponential().split("e");
  const exp = Number(expStr);
  const neg = mant.startsWith("-");
  const digits = mant.replace("-", "").replace(".", "");
  let body;
  if (exp < -4 || exp >= 16) {
    const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    body = `${m}e${exp < 0 ? "-" : "+"}${String(Math.abs(exp)).padStart(2, "0")}`;
  } else if (exp >= 0) {
    const intPart = digits.length > exp + 1 ? digits.slice(0, exp + 1) : digits.padEnd(exp + 1, "0");
    const frac = digits.length > exp + 1 ? digits.slice(exp + 1) : "0";
    body = `${intPart}.${frac}`;
  } else {
    body = `0.${"0".repeat(-exp - 1)}${digits}`;
  }
  return (neg ? "-" : "") + body;
}

const NON_PRINTABLE = /[\p{Cc}\p{Cf}\p{Cs}\p{Co}\p{Cn}\p{Zl}\p{Zp}\p{Zs}]/u;

/** Python repr(str). */
export function strRepr(s) {
  const quote = s.includes("'") && !s.includes('"') ? '"' : "'";
  let out = quote;
  for (const ch of s) {
    const cp = ch.codePointAt(0);
    if (ch === quote || ch === "\\") out += "\\" + ch;
    else if (ch === "\t") out += "\\t";
    else if (ch === "\n") out += "\\n";
    else if (ch === "\r") out += "\\r";
    else if (cp < 0x20 || cp === 0x7f) out += "\\x" + cp.toString(16).padStart(2, "0");
    else if (cp < 0x7f) out += ch;
    else if (cp !== 0x20 && NON_PRINTABLE.test(ch)) {
      if (cp <= 0xff) out += "\\x" + cp.toString(16).padStart(2, "0");
      else if (cp <= 0xffff) out += "\\u" + cp.toString(16).padStart(4, "0");
      else out += "\\U" + cp.toString(16).padStart(8, "0");
    } else out += ch;
  }
  return out + quote;
}

/** Python repr() of a JSON value (str, int, float, bool, None, list, dict). */
export function pyRepr(v) {
  if (v === null || v === undefined) return "None";
  if (typeof v === "string") return strRepr(v);
  if (typeof v === "boolean") return v ? "True" : "False";
  if (v instanceof PyInt || typeof v === "bigint") return String(v);
  if (v instanceof PyFloat) return floatRepr(v.value);
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : floatRepr(v);
  if (Array.isArray(v)) return `[${v.map(pyRepr).join(", ")}]`;
  return `{${Object.keys(v).map((k) => `${strRepr(k)}: ${pyRepr(v[k])}`).join(", ")}}`;
}
