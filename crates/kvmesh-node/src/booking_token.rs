//! The booking handles `Router.Route` gives its callers: opaque, unguessable, and valid only
//! for the caller that routed.
//!
//! A handle is 48 hex digits: the core's booking id (8 bytes) and a 16-byte tag,
//! HMAC-SHA256(node key, id ‖ SHA-256(caller)) cut to 128 bits, where the caller ([`Caller`])
//! is the `authorization` header the `Route` call carried or, without one, the IP address it
//! came from. Nothing is stored: `FirstToken` and `Release` recompute the tag from the
//! handle's id and *their* caller, so a stranger can neither guess a handle (2^128 tags) nor
//! use one it saw with another token or from another host. (Not the connection itself: a
//! gateway's pool routes on one connection and releases on another.) The key is random per
//! process: a restarted node's handles are void, as are its bookings.

use kvmesh_core::load::BookingId;
use ring::{digest, hmac, rand::SecureRandom};
use std::net::IpAddr;

/// Who a booking handle is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A caller with an `authorization` header: that header's bytes.
    Token(Vec<u8>),
    /// A caller without one: the address it connected from (`None` when the transport has
    /// no address, as in-process tests).
    Address(Option<IpAddr>),
}

impl Caller {
    /// The caller of a gRPC request.
    pub fn of<T>(request: &tonic::Request<T>) -> Self {
        match request.metadata().get("authorization") {
            Some(v) => Caller::Token(v.as_bytes().to_vec()),
            None => Caller::Address(request.remote_addr().map(|a| a.ip())),
        }
    }

    /// The bytes the tag is computed over; the prefixes keep a token from posing as an address.
    fn identity(&self) -> Vec<u8> {
        match self {
            Caller::Token(t) => [b"token:".as_slice(), t].concat(),
            Caller::Address(a) => format!("address:{}", a.map_or(String::new(), |a| a.to_string())).into_bytes(),
        }
    }
}

/// A node's booking-handle key.
pub struct BookingKeys {
    key: hmac::Key,
}

impl std::fmt::Debug for BookingKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BookingKeys(<redacted>)")
    }
}

/// Why a handle was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    /// Not 48 hex digits.
    #[error("booking handle {0:?} is not the 48 hex digits Route returned")]
    Malformed(String),
    /// Its tag does not match: made by another caller, another node or process, or forged.
    #[error("booking handle not issued to this caller (another token, another node, or a restarted one)")]
    NotYours,
}

impl BookingKeys {
    /// A fresh random key.
    ///
    /// # Panics
    /// If the system's random source fails (it does not on supported platforms).
    pub fn random() -> Self {
        let mut k = [0u8; 32];
        ring::rand::SystemRandom::new().fill(&mut k).expect("system random source");
        BookingKeys { key: hmac::Key::new(hmac::HMAC_SHA256, &k) }
    }

    /// The handle of `id` for `caller`.
    pub fn issue(&self, id: BookingId, caller: &Caller) -> String {
        let tag = self.tag(id, caller);
        let mut out = String::with_capacity(48);
        for b in id.0.to_be_bytes().iter().chain(tag.iter()) {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }

    /// The booking `handle` names, if it was issued to `caller`.
    ///
    /// # Errors
    /// [`HandleError`].
    pub fn open(&self, handle: &str, caller: &Caller) -> Result<BookingId, HandleError> {
        let malformed = || HandleError::Malformed(handle.chars().take(64).collect());
        if handle.len() != 48 || !handle.is_ascii() {
            return Err(malformed());
        }
        let mut bytes = [0u8; 24];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&handle[2 * i..2 * i + 2], 16).map_err(|_| malformed())?;
        }
        let id = BookingId(u64::from_be_bytes(bytes[..8].try_into().expect("8 bytes")));
        let want = self.tag(id, caller);
        // Every byte compared, whatever differs.
        let diff = want.iter().zip(&bytes[8..]).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff != 0 {
            return Err(HandleError::NotYours);
        }
        Ok(id)
    }

    fn tag(&self, id: BookingId, caller: &Caller) -> [u8; 16] {
        let caller = digest::digest(&digest::SHA256, &caller.identity());
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(&id.0.to_be_bytes());
        ctx.update(caller.as_ref());
        let full = ctx.sign();
        full.as_ref()[..16].try_into().expect("SHA-256 gives 32 bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(token: Option<&str>) -> Caller {
        match token {
            Some(t) => Caller::Token(format!("Bearer {t}").into_bytes()),
            None => Caller::Address(Some("10.0.0.1".parse().unwrap())),
        }
    }

    #[test]
    fn a_handle_opens_for_its_caller_only() {
        let keys = BookingKeys::random();
        let (alice, bob, anon) = (caller(Some("alice")), caller(Some("bob")), caller(None));
        let h = keys.issue(BookingId(7), &alice);
        assert_eq!(h.len(), 48);
        assert!(h.starts_with("0000000000000007"));
        assert_eq!(keys.open(&h, &alice), Ok(BookingId(7)));
        assert_eq!(keys.open(&h, &bob), Err(HandleError::NotYours));
        assert_eq!(keys.open(&h, &anon), Err(HandleError::NotYours));
        // The id cannot be swapped under a valid tag.
        let forged = format!("0000000000000008{}", &h[16..]);
        assert_eq!(keys.open(&forged, &alice), Err(HandleError::NotYours));
        // Another process's key.
        assert_eq!(BookingKeys::random().open(&h, &alice), Err(HandleError::NotYours));
        let anon_h = keys.issue(BookingId(7), &anon);
        assert_ne!(anon_h, h);
        assert_eq!(keys.open(&anon_h, &anon), Ok(BookingId(7)));
        // Without a token, another host is another caller.
        let elsewhere = Caller::Address(Some("10.0.0.2".parse().unwrap()));
        assert_eq!(keys.open(&anon_h, &elsewhere), Err(HandleError::NotYours));
        assert_eq!(keys.open(&anon_h, &Caller::Address(None)), Err(HandleError::NotYours));
        // A token spelled as an address's identity is still a token.
        assert_eq!(keys.open(&anon_h, &Caller::Token(b"10.0.0.1".to_vec())), Err(HandleError::NotYours));
        assert_eq!(keys.open("7", &anon), Err(HandleError::Malformed("7".into())));
        assert_eq!(keys.open(&"zz".repeat(24), &anon), Err(HandleError::Malformed("zz".repeat(24))));
    }
}
