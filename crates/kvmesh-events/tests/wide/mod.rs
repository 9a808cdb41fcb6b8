//! A msgpack writer that picks, for each value, any encoding of it the format allows — an
//! integer in every marker wide enough (signed ones for non-negative values too), strings,
//! binary, arrays, maps and extensions with every length header that fits — where rmpv's
//! writer always takes the smallest. vLLM (msgspec) and SGLang write the smallest too, but a
//! decoder must read them all.

use rmpv::Value;

/// Writes `v`, each choice of encoding taken from `pick` (any bytes; cycled).
pub fn encode(v: &Value, pick: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = 0usize;
    let mut next = || {
        let b = pick.get(at % pick.len().max(1)).copied().unwrap_or(0);
        at += 1;
        b
    };
    write(v, &mut next, &mut out);
    out
}

fn write(v: &Value, next: &mut impl FnMut() -> u8, out: &mut Vec<u8>) {
    match v {
        Value::Nil => out.push(0xc0),
        Value::Boolean(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), signed) => {
                // Unsigned markers that fit, then signed ones that fit, then the fixint.
                let mut ways: Vec<(u8, usize)> =
                    [(0xcc, 1), (0xcd, 2), (0xce, 4), (0xcf, 8)].into_iter().filter(|&(_, n)| fits_u(u, n)).collect();
                if let Some(s) = signed {
                    ways.extend(
                        [(0xd0, 1), (0xd1, 2), (0xd2, 4), (0xd3, 8)].into_iter().filter(|&(_, n)| fits_i(s, n)),
                    );
                }
                match usize::from(next()) % (ways.len() + usize::from(u < 128)) {
                    k if k < ways.len() => {
                        let (marker, n) = ways[k];
                        out.push(marker);
                        out.extend_from_slice(&u.to_be_bytes()[8 - n..]);
                    }
                    _ => out.push(u as u8),
                }
            }
            (None, Some(s)) => {
                let ways: Vec<(u8, usize)> =
                    [(0xd0, 1), (0xd1, 2), (0xd2, 4), (0xd3, 8)].into_iter().filter(|&(_, n)| fits_i(s, n)).collect();
                match usize::from(next()) % (ways.len() + usize::from(s >= -32)) {
                    k if k < ways.len() => {
                        let (marker, n) = ways[k];
                        out.push(marker);
                        out.extend_from_slice(&s.to_be_bytes()[8 - n..]);
                    }
                    _ => out.push(s as u8),
                }
            }
            (None, None) => unreachable!("a msgpack integer is a u64 or an i64"),
        },
        Value::F32(f) => {
            out.push(0xca);
            out.extend_from_slice(&f.to_be_bytes());
        }
        Value::F64(f) => {
            out.push(0xcb);
            out.extend_from_slice(&f.to_be_bytes());
        }
        Value::String(s) => {
            let bytes = s.as_bytes();
            header(bytes.len(), Some(0xa0), 32, [0xd9, 0xda, 0xdb], next, out);
            out.extend_from_slice(bytes);
        }
        Value::Binary(b) => {
            header(b.len(), None, 0, [0xc4, 0xc5, 0xc6], next, out);
            out.extend_from_slice(b);
        }
        Value::Array(items) => {
            header(items.len(), Some(0x90), 16, [0, 0xdc, 0xdd], next, out);
            for item in items {
                write(item, next, out);
            }
        }
        Value::Map(pairs) => {
            header(pairs.len(), Some(0x80), 16, [0, 0xde, 0xdf], next, out);
            for (k, v) in pairs {
                write(k, next, out);
                write(v, next, out);
            }
        }
        Value::Ext(t, data) => {
            let fixed = match data.len() {
                1 => Some(0xd4),
                2 => Some(0xd5),
                4 => Some(0xd6),
                8 => Some(0xd7),
                16 => Some(0xd8),
                _ => None,
            };
            match fixed.filter(|_| next().is_multiple_of(2)) {
                Some(marker) => out.push(marker),
                None => header(data.len(), None, 0, [0xc7, 0xc8, 0xc9], next, out),
            }
            out.push(*t as u8);
            out.extend_from_slice(data);
        }
    }
}

/// A length header: the fix form (`fix` | len, when len < `fix_below`) or a 1-, 2- or 4-byte
/// length after the marker in `sized` (0: that width does not exist for the type), whichever
/// `next` picks among those that fit.
fn header(
    len: usize,
    fix: Option<u8>,
    fix_below: usize,
    sized: [u8; 3],
    next: &mut impl FnMut() -> u8,
    out: &mut Vec<u8>,
) {
    let mut ways: Vec<(u8, usize)> =
        sized.into_iter().zip([1, 2, 4]).filter(|&(m, n)| m != 0 && fits_u(len as u64, n)).collect();
    if let Some(f) = fix.filter(|_| len < fix_below) {
        ways.push((f, 0));
    }
    let (marker, n) = ways[usize::from(next()) % ways.len()];
    if n == 0 {
        out.push(marker | len as u8);
    } else {
        out.push(marker);
        out.extend_from_slice(&(len as u64).to_be_bytes()[8 - n..]);
    }
}

fn fits_u(v: u64, bytes: usize) -> bool {
    bytes >= 8 || v < 1 << (8 * bytes)
}

fn fits_i(v: i64, bytes: usize) -> bool {
    bytes >= 8 || (-(1i64 << (8 * bytes - 1))..1i64 << (8 * bytes - 1)).contains(&v)
}
