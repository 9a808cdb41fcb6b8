//! Reading msgpack in place: a payload's values as borrowed bytes and scalars, with no tree.
//!
//! Decoding through an `rmpv::Value` tree cost an allocation per container and a 40-byte
//! value per element: a prefill batch's 512 token ids became a 20 KiB array of values before
//! they became 2 KiB of `u32`s, on every event batch a node follows. A [`Cursor`] reads each
//! header where it lies ([`rmp::Marker`] names them) and hands out scalars, string and binary
//! bytes as slices of the payload, and whole values as [`Cursor::value`] slices to read later.
//!
//! Nothing here panics or allocates on any bytes: running out of bytes reads as
//! [`Item::Truncated`], and loops over a declared length stop at the bytes' end
//! ([`Cursor::at_most`]). (The decoder checks the payload with [`crate::check_budget`] first, so
//! a complete payload never shows either.)

use rmp::Marker;

/// A msgpack integer as sent, normalised as `rmpv` does: non-negative values are `Pos`
/// whichever marker carried them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    /// Zero or more.
    Pos(u64),
    /// Below zero.
    Neg(i64),
}

impl Int {
    fn of_i64(v: i64) -> Self {
        u64::try_from(v).map_or(Int::Neg(v), Int::Pos)
    }

    pub(crate) fn as_u64(self) -> Option<u64> {
        match self {
            Int::Pos(v) => Some(v),
            Int::Neg(_) => None,
        }
    }

    pub(crate) fn as_i64(self) -> Option<i64> {
        match self {
            Int::Pos(v) => i64::try_from(v).ok(),
            Int::Neg(v) => Some(v),
        }
    }

    pub(crate) fn as_f64(self) -> f64 {
        match self {
            Int::Pos(v) => v as f64,
            Int::Neg(v) => v as f64,
        }
    }
}

impl std::fmt::Display for Int {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Int::Pos(v) => v.fmt(f),
            Int::Neg(v) => v.fmt(f),
        }
    }
}

/// One value's header, and its scalar or bytes. A container's elements (a map's keys and
/// values alternating) follow it in the cursor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Item<'a> {
    Nil,
    Bool,
    Int(Int),
    F32(f32),
    F64(f64),
    /// A string's bytes (not checked for UTF-8).
    Str(&'a [u8]),
    Bin(&'a [u8]),
    /// An array of this many values.
    Array(usize),
    /// A map of this many key-value pairs.
    Map(usize),
    Ext,
    /// Marker 0xc1, which msgpack never uses.
    Reserved,
    /// The bytes ended inside the value.
    Truncated,
}

impl Item<'_> {
    /// The value's type, for error messages (as `rmpv` values were named before).
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Item::Nil => "nil",
            Item::Bool => "a boolean",
            Item::Int(_) => "an integer",
            Item::F32(_) | Item::F64(_) => "a float",
            Item::Str(_) => "a string",
            Item::Bin(_) => "binary",
            Item::Array(_) => "an array",
            Item::Map(_) => "a map",
            Item::Ext => "an extension",
            Item::Reserved => "the reserved marker",
            Item::Truncated => "cut short",
        }
    }
}

/// A read position in msgpack bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Cursor { rest: bytes }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// `declared` values capped at the bytes left (each value takes at least one): a loop over
    /// a container's declared length never outruns its bytes, checked or not.
    pub(crate) fn at_most(&self, declared: usize) -> usize {
        declared.min(self.rest.len())
    }

    /// The first value's header of `bytes`.
    pub(crate) fn first(bytes: &'a [u8]) -> Item<'a> {
        Cursor::new(bytes).item()
    }

    /// Reads the next value's header (and its scalar or bytes).
    pub(crate) fn item(&mut self) -> Item<'a> {
        let Some((&marker, rest)) = self.rest.split_first() else {
            return Item::Truncated;
        };
        self.rest = rest;
        // Token ids and block hashes, most of a batch's values, without the general dispatch.
        let unsigned = match marker {
            0x00..=0x7f => return Item::Int(Int::Pos(marker.into())),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            _ => return self.after(Marker::from_u8(marker)).unwrap_or(Item::Truncated),
        };
        unsigned.map_or(Item::Truncated, |v| Item::Int(Int::Pos(v)))
    }

    /// Skips the next value whole (a container with everything in it) and returns its bytes;
    /// `None` when the bytes end inside it or hold the reserved marker.
    pub(crate) fn value(&mut self) -> Option<&'a [u8]> {
        let start = self.rest;
        // Values still to skip; each read consumes at least one byte, so a declared length
        // larger than the bytes ends at `Truncated`, not in a long loop.
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            match self.item() {
                Item::Array(n) => pending += n as u64,
                Item::Map(n) => pending += 2 * n as u64,
                Item::Truncated | Item::Reserved => return None,
                _ => {}
            }
        }
        Some(&start[..start.len() - self.rest.len()])
    }

    #[inline]
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.rest.len() {
            return None;
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Some(head)
    }

    /// An `n`-byte big-endian unsigned integer.
    #[inline]
    fn be(&mut self, n: usize) -> Option<u64> {
        Some(self.take(n)?.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn len(&mut self, n: usize) -> Option<usize> {
        usize::try_from(self.be(n)?).ok()
    }

    fn after(&mut self, marker: Marker) -> Option<Item<'a>> {
        Some(match marker {
            Marker::FixPos(n) => Item::Int(Int::Pos(n.into())),
            Marker::FixNeg(n) => Item::Int(Int::Neg(n.into())),
            Marker::Null => Item::Nil,
            Marker::False | Marker::True => Item::Bool,
            Marker::U8 => Item::Int(Int::Pos(self.be(1)?)),
            Marker::U16 => Item::Int(Int::Pos(self.be(2)?)),
            Marker::U32 => Item::Int(Int::Pos(self.be(4)?)),
            Marker::U64 => Item::Int(Int::Pos(self.be(8)?)),
            Marker::I8 => Item::Int(Int::of_i64(i8::from_be_bytes(self.array()?).into())),
            Marker::I16 => Item::Int(Int::of_i64(i16::from_be_bytes(self.array()?).into())),
            Marker::I32 => Item::Int(Int::of_i64(i32::from_be_bytes(self.array()?).into())),
            Marker::I64 => Item::Int(Int::of_i64(i64::from_be_bytes(self.array()?))),
            Marker::F32 => Item::F32(f32::from_be_bytes(self.array()?)),
            Marker::F64 => Item::F64(f64::from_be_bytes(self.array()?)),
            Marker::FixStr(n) => Item::Str(self.take(n.into())?),
            Marker::Str8 => Item::Str(self.sized(1)?),
            Marker::Str16 => Item::Str(self.sized(2)?),
            Marker::Str32 => Item::Str(self.sized(4)?),
            Marker::Bin8 => Item::Bin(self.sized(1)?),
            Marker::Bin16 => Item::Bin(self.sized(2)?),
            Marker::Bin32 => Item::Bin(self.sized(4)?),
            Marker::FixArray(n) => Item::Array(n.into()),
            Marker::Array16 => Item::Array(self.len(2)?),
            Marker::Array32 => Item::Array(self.len(4)?),
            Marker::FixMap(n) => Item::Map(n.into()),
            Marker::Map16 => Item::Map(self.len(2)?),
            Marker::Map32 => Item::Map(self.len(4)?),
            // An extension: its type byte, then its data.
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => self.sized_ext(1)?,
            Marker::Ext16 => self.sized_ext(2)?,
            Marker::Ext32 => self.sized_ext(4)?,
            Marker::Reserved => Item::Reserved,
        })
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    /// Bytes led by an `n`-byte length.
    fn sized(&mut self, n: usize) -> Option<&'a [u8]> {
        let len = self.len(n)?;
        self.take(len)
    }

    fn ext(&mut self, data: usize) -> Option<Item<'a>> {
        self.take(data.checked_add(1)?).map(|_| Item::Ext)
    }

    fn sized_ext(&mut self, n: usize) -> Option<Item<'a>> {
        let len = self.len(n)?;
        self.ext(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_normalised_as_rmpv_does() {
        // i8 5 (0xd0 0x05) is the same value as fixint 5; i16 −300; u64 2^63.
        assert_eq!(Cursor::first(&[0xd0, 0x05]), Item::Int(Int::Pos(5)));
        assert_eq!(Cursor::first(&[0xd1, 0xfe, 0xd4]), Item::Int(Int::Neg(-300)));
        assert_eq!(Cursor::first(&[0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0]), Item::Int(Int::Pos(1 << 63)));
        assert_eq!(Int::Pos(1 << 63).as_i64(), None);
        assert_eq!(Int::Neg(-1).as_u64(), None);
        assert_eq!(Cursor::first(&[0xff]), Item::Int(Int::Neg(-1)));
    }

    #[test]
    fn a_value_is_skipped_whole_and_a_cut_one_is_none() {
        // [1, {"a": [nil]}, "xy"] then a trailing 7.
        let bytes = [0x93, 0x01, 0x81, 0xa1, b'a', 0x91, 0xc0, 0xa2, b'x', b'y', 0x07];
        let mut c = Cursor::new(&bytes);
        assert_eq!(c.value(), Some(&bytes[..10]));
        assert_eq!(c.item(), Item::Int(Int::Pos(7)));
        assert_eq!(c.item(), Item::Truncated);
        for cut in 0..10 {
            assert_eq!(Cursor::new(&bytes[..cut]).value(), None, "cut at {cut}");
        }
        // An array declaring 2^32 − 1 values in 5 bytes ends at the bytes' end.
        assert_eq!(Cursor::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).value(), None);
    }

    #[test]
    fn strings_binary_and_extensions_are_borrowed_or_skipped() {
        let mut c = Cursor::new(&[0xd9, 0x02, b'h', b'i', 0xc4, 0x01, 0x09, 0xd5, 0x01, 0xaa, 0xbb, 0xc1]);
        assert_eq!(c.item(), Item::Str(b"hi"));
        assert_eq!(c.item(), Item::Bin(&[0x09]));
        assert_eq!(c.item(), Item::Ext);
        assert_eq!(c.item(), Item::Reserved);
        assert_eq!(c.remaining(), 0);
    }
}
