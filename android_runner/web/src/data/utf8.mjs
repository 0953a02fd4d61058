// bytes.decode("utf-8-sig") with CPython's error report: on invalid UTF-8 the reason
// ("invalid start byte", "invalid continuation byte", "unexpected end of data") and the start of
// the bad sequence, counted (like the utf-8-sig codec) from after a leading BOM.

export class UnicodeDecodeError extends Error {
  constructor(reason, start) {
    super(`'utf-8' codec can't decode byte at position ${start}: ${reason}`);
    this.name = "UnicodeDecodeError";
    this.reason = reason;
    this.start = start;
  }
}

const isCont = (b) => b >= 0x80 && b <= 0xbf;

/** First UTF-8 error in b (CPython's decoder rules) as [reason, start], or null. */
export function findUtf8Error(b) {
  const n = b.length;
  let i = 0;
  while (i < n) {
    const c = b[i];
    if (c < 0x80) { i++; continue; }
    const left = n - i;
    if (c < 0xc2) return ["invalid start byte", i];
    if (c < 0xe0) {
      if (left < 2) return ["unexpected end of data", i];
      if (!isCont(b[i + 1])) return ["invalid continuation byte", i];
      i += 2;
      continue;
    }
    if (c < 0xf0) {
      const bad2 = (x) => !isCont(x) || (x < 0xa0 ? c === 0xe0 : c === 0xed);
      if (left < 3) {
        if (left < 2) return ["unexpected end of data", i];
        if (bad2(b[i + 1])) return ["invalid continuation byte", i];
        return ["unexpected end of data", i];
      }
      if (bad2(b[i + 1])) return ["invalid continuation byte", i];
      if (!isCont(b[i + 2])) return ["invalid continuation byte", i];
      i += 3;
      continue;
    }
    if (c < 0xf5) {
      const bad2 = (x) => !isCont(x) || (x < 0x90 ? c === 0xf0 : c === 0xf4);
      if (left < 4) {
        if (left < 2) return ["unexpected end of data", i];
        if (bad2(b[i + 1])) return ["invalid continuation byte", i];
        if (left < 3) return ["unexpected end of data", i];
        if (!isCont(b[i + 2])) return ["invalid continuation byte", i];
        return ["unexpected end of data", i];
      }
      if (bad2(b[i + 1])) return ["invalid continuation byte", i];
      if (!isCont(b[i + 2]) || !isCont(b[i + 3])) return ["invalid continuation byte", i];
      i += 4;
      continue;
    }
    return ["invalid start byte", i];
  }
  return null;
}

/** Decode like Python's raw.decode("utf-8-sig"); throws UnicodeDecodeError. */
export function decodeUtf8Sig(bytes) {
  const raw = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  const bom = raw.length >= 3 && raw[0] === 0xef && raw[1] === 0xbb && raw[2] === 0xbf;
  const body = bom ? raw.subarray(3) : raw;
  try {
    return new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }).decode(body);
  } catch {
    const err = findUtf8Error(body);
    if (err) throw new UnicodeDecodeError(err[0], err[1]);
    throw new UnicodeDecodeError("invalid data", 0);
  }
}
