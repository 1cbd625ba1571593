//! The header fields of a forwarded request and of the response: hop-by-hop fields removed,
//! the forwarding fields (`Via`, `X-Forwarded-*`) set from the gateway's own view
//! (RFC 9110 §7.6).

use std::net::SocketAddr;

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};

/// Hop-by-hop header fields (RFC 9110 §7.6.1), removed in both directions together with any
/// field named in `Connection`. Names, not strings: removing by `&str` parses and classifies
/// the string on every call.
/// `Proxy-Authenticate` and `Proxy-Authorization` are for the proxy next to the client, never
/// the backend (RFC 9110 §11.7).
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
];

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Removes hop-by-hop fields from `headers` (RFC 9110 §7.6.1).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass over the names costs less than a lookup per field
    // (a field named in `Connection` implies `Connection` itself).
    if !headers.keys().any(|k| HOP_BY_HOP.contains(k)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The headers sent to the backend: the client's `headers`, minus hop-by-hop fields and
/// `Expect` (the gateway has read the body already), with `Content-Length` recomputed from the
/// buffered body and:
/// - `via`, this replica's `Via` for the client's protocol version (RFC 9110 §7.6.3);
/// - `X-Forwarded-For`: every line the client sent, joined in order (RFC 9110 §5.3), then the
///   client's address `peer_ip`;
/// - `X-Forwarded-Host`: the host the client asked for, `target_host` (the absolute-form
///   target's authority, else `Host`, RFC 9112 §3.2.2), replacing any the client sent;
/// - `X-Forwarded-Proto: http`.
///
/// `Authorization` is passed through.
pub(super) fn forward_headers(
    mut h: HeaderMap,
    via: HeaderValue,
    target_host: Option<HeaderValue>,
    peer_ip: Option<&HeaderValue>,
) -> HeaderMap {
    strip_hop_by_hop(&mut h);
    h.reserve(4);
    h.remove(header::CONTENT_LENGTH);
    h.remove(header::EXPECT);
    h.remove(header::HOST);
    match target_host {
        Some(host) => h.insert(X_FORWARDED_HOST, host),
        None => h.remove(X_FORWARDED_HOST),
    };
    h.append(header::VIA, via);
    if let Some(ip) = peer_ip {
        let mut lines = h.get_all(&X_FORWARDED_FOR).iter().peekable();
        let v = if lines.peek().is_none() {
            Some(ip.clone())
        } else {
            let mut v = Vec::with_capacity(64);
            for line in lines {
                v.extend_from_slice(line.as_bytes());
                v.extend_from_slice(b", ");
            }
            v.extend_from_slice(ip.as_bytes());
            HeaderValue::from_bytes(&v).ok()
        };
        if let Some(v) = v {
            h.insert(X_FORWARDED_FOR, v);
        }
    }
    h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    h
}

/// The client's IP address as a header value, for `X-Forwarded-For`: made once per connection.
/// An IPv4 client of the dual-stack listener (`::ffff:10.0.0.7`) is written as IPv4.
pub(crate) fn peer_ip_value(peer: SocketAddr) -> Option<HeaderValue> {
    HeaderValue::from_str(&peer.ip().to_canonical().to_string()).ok()
}

/// The `Via` field value a replica adds to forwarded requests (RFC 9110 §7.6.3):
/// `1.1 hearth-gateway (<instance>)`, the comment naming the replica (its random
/// [`crate::demand::DemandHub::instance`]). A request that already carries it has come back to
/// the replica that forwarded it: a backend that leads back to the gateway. Such a request is
/// answered `508` instead of being forwarded again until `maxQueue` fills (§7.6.3: an
/// intermediary must not forward a message to itself unprotected from a loop).
#[derive(Debug)]
pub struct Via {
    http10: HeaderValue,
    http11: HeaderValue,
    token: Vec<u8>,
}

impl Via {
    /// The values of the replica `instance`.
    pub fn new(instance: u64) -> Self {
        let token = format!("hearth-gateway ({instance:016x})");
        let value = |v: &str| {
            HeaderValue::from_str(&format!("{v} {token}"))
                .unwrap_or_else(|_| HeaderValue::from_static("1.1 hearth-gateway"))
        };
        Self {
            http10: value("1.0"),
            http11: value("1.1"),
            token: token.into_bytes(),
        }
    }

    /// The value for a request received with `version`.
    pub(super) fn value(&self, version: http::Version) -> HeaderValue {
        if version == http::Version::HTTP_10 {
            self.http10.clone()
        } else {
            self.http11.clone()
        }
    }

    /// Whether `headers` show the request already passed through this replica.
    pub(super) fn seen_in(&self, headers: &HeaderMap) -> bool {
        headers.get_all(header::VIA).iter().any(|v| {
            v.as_bytes()
                .windows(self.token.len())
                .any(|w| w == self.token.as_slice())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_named_fields() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        h.insert("x-end-to-end", HeaderValue::from_static("kept"));
        strip_hop_by_hop(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left.len(), 2, "{left:?}");
        assert_eq!(h[header::AUTHORIZATION], "Bearer k");
        assert_eq!(h["x-end-to-end"], "kept");
    }

    #[test]
    fn forwarding_fields_are_the_gateways_view() {
        let mut h = HeaderMap::new();
        h.append(X_FORWARDED_FOR, HeaderValue::from_static("1.1.1.1"));
        h.append(X_FORWARDED_FOR, HeaderValue::from_static("2.2.2.2"));
        h.insert(X_FORWARDED_HOST, HeaderValue::from_static("claimed"));
        h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("https"));
        h.insert(header::HOST, HeaderValue::from_static("gw:8000"));
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        h.insert(header::EXPECT, HeaderValue::from_static("100-continue"));
        h.insert(header::VIA, HeaderValue::from_static("1.1 edge"));
        let via = Via::new(7);
        let out = forward_headers(
            h,
            via.value(http::Version::HTTP_11),
            Some(HeaderValue::from_static("gw:8000")),
            Some(&HeaderValue::from_static("10.0.0.7")),
        );
        assert_eq!(out[X_FORWARDED_FOR], "1.1.1.1, 2.2.2.2, 10.0.0.7");
        assert_eq!(out[X_FORWARDED_HOST], "gw:8000");
        assert_eq!(out[X_FORWARDED_PROTO], "http");
        let vias: Vec<_> = out.get_all(header::VIA).iter().collect();
        assert_eq!(vias, ["1.1 edge", "1.1 hearth-gateway (0000000000000007)"]);
        for gone in [header::HOST, header::CONTENT_LENGTH, header::EXPECT] {
            assert!(!out.contains_key(&gone), "{gone}");
        }
        // No target host: a claimed one is not passed on.
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_HOST, HeaderValue::from_static("claimed"));
        let out = forward_headers(h, via.value(http::Version::HTTP_10), None, None);
        assert!(!out.contains_key(X_FORWARDED_HOST));
        assert!(!out.contains_key(X_FORWARDED_FOR));
        assert_eq!(out[header::VIA], "1.0 hearth-gateway (0000000000000007)");
    }

    #[test]
    fn via_tells_this_replica_from_others() {
        let (mine, other) = (Via::new(1), Via::new(2));
        let mut h = HeaderMap::new();
        assert!(!mine.seen_in(&h));
        h.append(header::VIA, other.value(http::Version::HTTP_11));
        assert!(!mine.seen_in(&h));
        h.append(
            header::VIA,
            HeaderValue::from_static("1.0 a, 1.1 hearth-gateway (0000000000000001)"),
        );
        assert!(mine.seen_in(&h));
    }

    #[test]
    fn the_client_address_is_written_as_ipv4_when_it_is_one() {
        let v4_mapped: SocketAddr = "[::ffff:10.0.0.7]:5000".parse().unwrap();
        assert_eq!(peer_ip_value(v4_mapped).unwrap(), "10.0.0.7");
        let v6: SocketAddr = "[fe80::1]:5000".parse().unwrap();
        assert_eq!(peer_ip_value(v6).unwrap(), "fe80::1");
    }
}
