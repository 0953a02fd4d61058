// Python's number formatting and parsing where the gate's texts and numbers depend on it, so that a reason, an
// error message or a run summary reads byte for byte as android_runner/gate.py and probes.py write them:
// `format(x, 'g')`, `format(x, '.0%')`, `round(x, n)`, `repr(x)` and `float(text)`. Rounding is done on the
// double's exact decimal value, half to even, like CPython (JS's toFixed/toPrecision round ties up).
// Pure JS: no Node or browser APIs.

const view = new DataView(new ArrayBuffer(8));

/** |x| (finite) as [D, s] with |x| = D / 10**s exactly (D a BigInt, s >= 0). */
function exactDecimal(x) {
  view.setFloat64(0, x);
  const hi = view.getUint32(0), lo = view.getUint32(4);
  const bexp = (hi >>> 20) & 0x7ff;
  let m = (BigInt(hi & 0xfffff) << 32n) | BigInt(lo);
  let e = -1074;
  if (bexp !== 0) { m |= 1n << 52n; e = bexp - 1075; }
  if (e >= 0) return [m << BigInt(e), 0];
  return [m * 5n ** BigInt(-e), -e];   // m / 2**k = m * 5**k / 10**k
}

/** D / 10**cut rounded half to even (cut >= 0). */
function roundHalfEven(D, cut) {
  if (cut <= 0) return D;
  const p = 10n ** BigInt(cut);
  let q = D / p;
  const r2 = (D % p) * 2n;
  if (r2 > p || (r2 === p && q % 2n === 1n)) q += 1n;
  return q;
}

const negative = (x) => x < 0 || Object.is(x, -0);

function special(x) {
  if (Number.isNaN(x)) return 'nan';
  if (x === Infinity) return 'inf';
  if (x === -Infinity) return '-inf';
  return null;
}

/** Python's `format(x, f'.{digits}f')`. */
export function formatFixed(x, digits) {
  const sp = special(x);
  if (sp !== null) return sp;
  const [D, s] = exactDecimal(x);
  const q = digits >= s ? D * 10n ** BigInt(digits - s) : roundHalfEven(D, s - digits);
  let t = q.toString().padStart(digits + 1, '0');
  if (digits > 0) t = `${t.slice(0, t.length - digits)}.${t.slice(t.length - digits)}`;
  return (negative(x) ? '-' : '') + t;
}

/** Python's `format(x, 'g')` (precision 6) or `format(x, f'.{precision}g')`. */
export function formatG(x, precision = 6) {
  const sp = special(x);
  if (sp !== null) return sp;
  const sign = negative(x) ? '-' : '';
  if (x === 0) return `${sign}0`;
  const P = Math.max(1, precision);
  const [D, s] = exactDecimal(x);
  const len = D.toString().length;
  let X = len - 1 - s;                                  // decimal exponent of the first digit
  let q = len > P ? roundHalfEven(D, len - P) : D * 10n ** BigInt(P - len);
  if (q.toString().length > P) { q /= 10n; X += 1; }    // 9.999995 -> 10.0000
  const sig = q.toString();
  const strip = (t) => (t.includes('.') ? t.replace(/0+$/, '').replace(/\.$/, '') : t);
  if (X >= -4 && X < P) {
    const t = X >= 0 ? `${sig.slice(0, X + 1)}.${sig.slice(X + 1)}` : `0.${'0'.repeat(-X - 1)}${sig}`;
    return sign + strip(t);
  }
  const exp = `${X < 0 ? '-' : '+'}${String(Math.abs(X)).padStart(2, '0')}`;
  return `${sign}${strip(`${sig[0]}.${sig.slice(1)}`)}e${exp}`;
}

/** Python's `format(x, f'.{digits}%')`: x * 100 (a double multiplication, as CPython does), fixed, then '%'. */
export function formatPercent(x, digits = 0) {
  return `${formatFixed(x * 100, digits)}%`;
}

/** Python's `round(x, ndigits)` for a float: correctly rounded, half to even. */
export function pyRound(x, ndigits) {
  if (!Number.isFinite(x)) return x;
  return Number(formatFixed(x, ndigits));
}

/** Python's `repr(x)` for a float. */
export function floatRepr(x) {
  const sp = special(x);
  if (sp !== null) return sp;
  if (x === 0) return negative(x) ? '-0.0' : '0.0';
  const [mant, e] = Math.abs(x).toExponential().split('e');   // shortest round-trip digits
  const digits = mant.replace('.', '');
  const X = Number(e);
  const sign = x < 0 ? '-' : '';
  if (X < -4 || X >= 16) {
    const m = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    return `${sign}${m}e${X < 0 ? '-' : '+'}${String(Math.abs(X)).padStart(2, '0')}`;
  }
  if (X < 0) return `${sign}0.${'0'.repeat(-X - 1)}${digits}`;
  const intPart = digits.slice(0, X + 1).padEnd(X + 1, '0');
  const frac = digits.slice(X + 1);
  return `${sign}${intPart}.${frac || '0'}`;
}

function strRepr(s) {
  const quote = s.includes("'") && !s.includes('"') ? '"' : "'";
  let out = quote;
  for (const ch of s) {
    const c = ch.codePointAt(0);
    if (ch === '\\' || ch === quote) out += `\\${ch}`;
    else if (ch === '\n') out += '\\n';
    else if (ch === '\r') out += '\\r';
    else if (ch === '\t') out += '\\t';
    else if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c === 0xad) out += `\\x${c.toString(16).padStart(2, '0')}`;
    else out += ch;
  }
  return out + quote;
}

/** Python's `repr()` of a JSON-like value (strings, numbers as floats, booleans, None, lists, dicts). */
export function pyRepr(v) {
  if (v === null || v === undefined) return 'None';
  if (v === true) return 'True';
  if (v === false) return 'False';
  if (typeof v === 'string') return strRepr(v);
  if (typeof v === 'number') return Number.isInteger(v) && Math.abs(v) < 2 ** 53 ? String(v) : floatRepr(v);
  if (typeof v === 'bigint') return v.toString();
  if (Array.isArray(v)) return `[${v.map(pyRepr).join(', ')}]`;
  if (typeof v === 'object') return `{${Object.entries(v).map(([k, x]) => `${strRepr(k)}: ${pyRepr(x)}`).join(', ')}}`;
  return String(v);
}

// str.isspace() characters: what Python's strip() and float() remove.
const PY_SPACE = '[\\t\\n\\v\\f\\r\\x1c-\\x1f \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]';
const STRIP = new RegExp(`^${PY_SPACE}+|${PY_SPACE}+$`, 'g');
export const pyStrip = (s) => s.replace(STRIP, '');

const DIGITS = '\\d(?:_?\\d)*';
const FLOAT_TEXT = new RegExp(`^[+-]?(?:(?:${DIGITS})?\\.${DIGITS}|${DIGITS}\\.?)(?:[eE][+-]?${DIGITS})?$`);
const FLOAT_SPECIAL = /^([+-]?)(inf|infinity|nan)$/i;

const pyTypeName = (v) => (v === null || v === undefined ? 'NoneType' : Array.isArray(v) ? 'list'
  : typeof v === 'object' ? 'dict' : typeof v === 'boolean' ? 'bool' : typeof v);

/**
 * Python's `float(v)`: numbers pass, strings are parsed as Python parses them (surrounding whitespace,
 * underscores between digits, inf/nan); anything else throws a TypeError, unparsable text a ValueError-like
 * Error, both with Python's message.
 */
export function pyFloat(v) {
  if (typeof v === 'number') return v;
  if (typeof v === 'boolean') return v ? 1 : 0;
  if (typeof v !== 'string') {
    throw new TypeError(`float() argument must be a string or a real number, not '${pyTypeName(v)}'`);
  }
  const t = pyStrip(v);
  if (FLOAT_TEXT.test(t)) return Number(t.replace(/_/g, ''));
  const m = FLOAT_SPECIAL.exec(t);
  if (m) {
    if (m[2].toLowerCase() === 'nan') return NaN;
    return m[1] === '-' ? -Infinity : Infinity;
  }
  throw new PyValueError(`could not convert string to float: ${pyRepr(v)}`);
}

/** Python's ValueError, for the places where Python's code catches ValueError but not TypeError. */
export class PyValueError extends Error {}

/** Python's truthiness of a JSON value (NaN is true in Python). */
export function pyTruthy(v) {
  if (v === null || v === undefined || v === false || v === '' || v === 0) return false;
  if (Array.isArray(v)) return v.length > 0;
  if (typeof v === 'object') return Object.keys(v).length > 0;
  return true;
}

/** Python's `str(v)` of a JSON value. */
export function pyStr(v) {
  if (typeof v === 'string') return v;
  if (typeof v === 'number' && Number.isFinite(v) && !Number.isInteger(v)) return floatRepr(v);
  return pyRepr(v);
}

/** The first n code points of s (Python slices strings by code point). */
export const codePointSlice = (s, n) => Array.from(s).slice(0, n).join('');
