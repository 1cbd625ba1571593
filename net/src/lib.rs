//! Listening sockets for Hearth's servers (webhook, controller metrics, gateway HTTP and gRPC,
//! the backend drain sidecar).
//!
//! Every Hearth server listens on `[::]:<port>` unless told otherwise, so the same flags work in
//! IPv4, IPv6 and dual-stack clusters (Kubernetes dual-stack networking, KEP-563):
//! - `[::]` is bound with `IPV6_V6ONLY` off, so IPv4 clients arrive too, as IPv4-mapped
//!   addresses (`::ffff:a.b.c.d`, RFC 4291 §2.5.5.2): use `IpAddr::to_canonical` before showing
//!   or forwarding a peer address.
//! - On a host without IPv6 (a kernel booted with `ipv6.disable=1`: `socket(AF_INET6)` fails with
//!   `EAFNOSUPPORT`), `[::]:<port>` falls back to `0.0.0.0:<port>`.
//! - Any other address is bound exactly as written.
//!
//! It also holds [`version!`], the version every Hearth binary prints with `--version`: all of
//! them depend on this crate.
//!
//! With the `process` feature, [`process`] is the runtime every binary starts with: crypto
//! provider, logs, signals and one way to report a failure. With `tls-server`, [`tls_server`]
//! is the bounded, draining HTTPS accept loop of the TLS servers.
//!
//! With the `secure-metrics` feature, [`secure_metrics`] authenticates and authorizes scrapes of
//! the controller's and the webhook's `/metrics` (TokenReview, SubjectAccessReview) and serves
//! them over HTTPS.

#[cfg(feature = "pki")]
pub mod pki;
#[cfg(feature = "process")]
pub mod process;
#[cfg(feature = "secure-metrics")]
pub mod secure_metrics;
#[cfg(feature = "tls-server")]
pub mod tls_server;

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};

use socket2::{Domain, Protocol, Socket, Type};

/// The version the binaries print with `--version`: `HEARTH_VERSION` at compile time
/// (`build/binaries` sets it to what `build/version` prints: the last commit that changed the
/// binaries' sources; the `build/Containerfile` build stage takes it as a build argument), else,
/// when unset or empty, the package version
/// (`CARGO_PKG_VERSION`, the workspace version).
///
/// A macro, not a `const`: `option_env!` is then read by the crate that prints the version, so
/// a new `HEARTH_VERSION` recompiles only that crate (cargo tracks the variable), not this one and
/// everything that depends on it.
///
/// ```
/// let version: &'static str = hearth_net::version!();
/// assert!(!version.is_empty());
/// ```
#[macro_export]
macro_rules! version {
    () => {
        match ::core::option_env!("HEARTH_VERSION") {
            ::core::option::Option::Some(version) if !version.is_empty() => version,
            _ => ::core::env!("CARGO_PKG_VERSION"),
        }
    };
}

/// Options of [`bind`].
#[derive(Debug, Clone, Copy)]
pub struct ListenOptions {
    /// `SO_REUSEPORT`: several sockets (one per worker thread) share the port and the kernel
    /// spreads connections over them.
    pub reuse_port: bool,
    /// Accept queue length passed to `listen(2)` (the kernel caps it at `net.core.somaxconn`).
    pub backlog: i32,
}

impl Default for ListenOptions {
    fn default() -> Self {
        Self {
            reuse_port: false,
            backlog: 1024,
        }
    }
}

/// A bound, listening, non-blocking socket.
#[derive(Debug)]
pub struct Listening {
    /// The socket; hand it to `tokio::net::TcpListener::from_std`.
    pub listener: TcpListener,
    /// The address actually bound: differs from the one asked for after the IPv4 fallback, or
    /// when the port asked for was 0.
    pub addr: SocketAddr,
    /// `true` when `[::]` was asked for and the host has no IPv6, so `0.0.0.0` was bound.
    pub ipv4_fallback: bool,
}

/// Parses a listen address for a command-line flag: `<IPv4>:<port>`, `[<IPv6>]:<port>`, or
/// `:<port>` for every address (the same as `[::]:<port>`, as in Go's `net.Listen`).
///
/// # Errors
/// A message with examples of valid values (host names are refused: a server listens on
/// addresses).
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    if let Some(port) = s.strip_prefix(':') {
        if let Ok(port) = port.parse::<u16>() {
            return Ok(SocketAddr::new(
                IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
                port,
            ));
        }
    } else if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    Err(format!(
        "{s:?} is not an address and port; use an IP address, like \"[::]:8080\" or \":8080\" (every address), \"0.0.0.0:8080\" (every IPv4 address) or \"127.0.0.1:8080\""
    ))
}

/// Binds and listens on `addr` (`SO_REUSEADDR` on, non-blocking).
///
/// `[::]:<port>` accepts IPv6 and IPv4 (dual-stack), and binds `0.0.0.0:<port>` instead when the
/// host has no IPv6; see the crate documentation.
///
/// # Errors
/// The failing system call's error (e.g. `AddrInUse`), with `addr` in its message.
pub fn bind(addr: SocketAddr, opts: ListenOptions) -> io::Result<Listening> {
    bind_with(addr, opts, |domain| {
        Socket::new(domain, Type::STREAM, Some(Protocol::TCP))
    })
}

/// [`bind`], as a tokio listener; logs the IPv4 fallback once.
///
/// # Errors
/// As [`bind`]. Must be called within a tokio runtime.
pub fn listen(addr: SocketAddr, opts: ListenOptions) -> io::Result<tokio::net::TcpListener> {
    let l = bind(addr, opts)?;
    if l.ipv4_fallback {
        tracing::info!(asked = %addr, bound = %l.addr, "this host has no IPv6: listening on IPv4 only");
    }
    tokio::net::TcpListener::from_std(l.listener)
}

/// [`bind`] with the socket constructor given, so tests can play a host without IPv6.
fn bind_with(
    addr: SocketAddr,
    opts: ListenOptions,
    new_socket: impl Fn(Domain) -> io::Result<Socket>,
) -> io::Result<Listening> {
    let dual_stack = matches!(addr.ip(), IpAddr::V6(ip) if ip.is_unspecified());
    match listen_on(addr, opts, dual_stack, &new_socket) {
        Err(e) if dual_stack && no_ipv6(&e) => {
            let v4 = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), addr.port());
            listen_on(v4, opts, false, &new_socket)
                .map(|l| Listening {
                    ipv4_fallback: true,
                    ..l
                })
                .map_err(|e| with_addr(e, v4))
        }
        r => r.map_err(|e| with_addr(e, addr)),
    }
}

fn listen_on(
    addr: SocketAddr,
    opts: ListenOptions,
    dual_stack: bool,
    new_socket: &impl Fn(Domain) -> io::Result<Socket>,
) -> io::Result<Listening> {
    let socket = new_socket(Domain::for_address(addr))?;
    if dual_stack {
        // Explicit: the default follows `net.ipv6.bindv6only`, which a node may set to 1.
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    if opts.reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(opts.backlog)?;
    socket.set_nonblocking(true)?;
    let listener: TcpListener = socket.into();
    let addr = listener.local_addr()?;
    Ok(Listening {
        listener,
        addr,
        ipv4_fallback: false,
    })
}

/// The errors of a host without IPv6: no `AF_INET6` sockets at all, or no IPv6 address to bind.
fn no_ipv6(e: &io::Error) -> bool {
    const EAFNOSUPPORT: i32 = 97;
    const EADDRNOTAVAIL: i32 = 99;
    matches!(e.raw_os_error(), Some(EAFNOSUPPORT | EADDRNOTAVAIL))
}

fn with_addr(e: io::Error, addr: SocketAddr) -> io::Error {
    io::Error::new(e.kind(), format!("binding {addr}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{Ipv6Addr, TcpStream};

    fn any6() -> SocketAddr {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
    }

    fn blocking(l: &Listening) -> &TcpListener {
        l.listener.set_nonblocking(false).unwrap();
        &l.listener
    }

    /// Connects to `to` and returns the peer address the listener saw.
    fn peer_seen(l: &Listening, to: SocketAddr) -> SocketAddr {
        let mut c = TcpStream::connect(to).unwrap();
        let (mut s, peer) = blocking(l).accept().unwrap();
        c.write_all(b"x").unwrap();
        let mut b = [0u8; 1];
        s.read_exact(&mut b).unwrap();
        peer
    }

    #[test]
    fn listen_addresses_parse_with_every_address_shorthand() {
        assert_eq!(parse_listen(":8080").unwrap(), "[::]:8080".parse().unwrap());
        assert_eq!(
            parse_listen("[::]:9090").unwrap(),
            "[::]:9090".parse().unwrap()
        );
        assert_eq!(
            parse_listen("127.0.0.1:0").unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        assert_eq!(
            parse_listen("[fd00::1]:80").unwrap(),
            "[fd00::1]:80".parse().unwrap()
        );
        for bad in [
            "",
            "foo",
            "8080",
            ":",
            ":99999",
            "localhost:8080",
            "127.0.0.1",
            "0.0.0.0:abc",
        ] {
            let e = parse_listen(bad).unwrap_err();
            assert!(e.contains("\":8080\""), "{bad}: {e}");
        }
    }

    #[test]
    fn unspecified_v6_accepts_ipv4_and_ipv6_clients() {
        let l = bind(any6(), ListenOptions::default()).unwrap();
        assert!(!l.ipv4_fallback);
        assert!(l.addr.is_ipv6());
        let port = l.addr.port();
        let v4 = peer_seen(&l, SocketAddr::from(([127, 0, 0, 1], port)));
        assert_eq!(
            v4.ip().to_canonical(),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            "IPv4 client seen as {v4}"
        );
        let v6 = peer_seen(&l, SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), port));
        assert_eq!(v6.ip().to_canonical(), IpAddr::V6(Ipv6Addr::LOCALHOST));
    }

    #[test]
    fn host_without_ipv6_falls_back_to_ipv4() {
        let no_v6 = |d: Domain| {
            if d == Domain::IPV6 {
                Err(io::Error::from_raw_os_error(97))
            } else {
                Socket::new(d, Type::STREAM, Some(Protocol::TCP))
            }
        };
        let l = bind_with(any6(), ListenOptions::default(), no_v6).unwrap();
        assert!(l.ipv4_fallback);
        assert_eq!(l.addr.ip(), IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        peer_seen(&l, SocketAddr::from(([127, 0, 0, 1], l.addr.port())));
    }

    #[test]
    fn an_explicit_v6_address_never_falls_back() {
        let no_v6 = |_: Domain| Err(io::Error::from_raw_os_error(97));
        let ll = SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 0);
        let e = bind_with(ll, ListenOptions::default(), no_v6).unwrap_err();
        assert!(e.to_string().contains("binding [::1]:0"), "{e}");
    }

    #[test]
    fn address_in_use_names_the_address() {
        let a = bind(any6(), ListenOptions::default()).unwrap();
        let e = bind(a.addr, ListenOptions::default()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        assert!(e.to_string().contains(&a.addr.to_string()), "{e}");
        // The IPv4 side of the dual-stack socket is taken too.
        let v4 = SocketAddr::from(([0, 0, 0, 0], a.addr.port()));
        assert_eq!(
            bind(v4, ListenOptions::default()).unwrap_err().kind(),
            io::ErrorKind::AddrInUse
        );
    }

    #[test]
    fn reuse_port_lets_workers_share_a_port() {
        let opts = ListenOptions {
            reuse_port: true,
            backlog: 16,
        };
        let a = bind(any6(), opts).unwrap();
        let b = bind(a.addr, opts).unwrap();
        assert_eq!(a.addr, b.addr);
    }
}
