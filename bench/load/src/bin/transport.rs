//! graphpool-transport: where does a round trip's time go on this machine? Measures the bare
//! transports that graphpoold's hot RPCs can use, with no daemon logic behind them:
//!
//! - `grpc`: a minimal tonic unary call (the health service's `Check`) over a Unix socket,
//!   through a tonic `Channel` (which queues every request into a buffer task);
//! - `grpc-direct`: the same call on a hyper HTTP/2 connection used directly (no buffer task);
//! - `raw`: a 4-byte-length-framed request/response on a Unix socket, served by a tokio task
//!   (what the fd socket does), client blocking (what the shim does).
//!
//! Server in its own process (this binary, `server` mode), on a tokio runtime of the flavour
//! asked for; one client process per measurement.
//!
//!   graphpool-transport [--n 20000] [--flavours multi,multi1,current]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("server") => server(&args),
        Some("client") => client(&args),
        _ => driver(&args),
    }
}

fn runtime(flavour: &str) -> tokio::runtime::Runtime {
    match flavour {
        "current" => tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap(),
        "multi1" => {
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
        }
        _ => tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap(),
    }
}

fn server(args: &[String]) {
    let dir = PathBuf::from(arg(args, "--dir").unwrap());
    let flavour = arg(args, "--flavour").unwrap();
    runtime(&flavour).block_on(async move {
        let (_reporter, health) = tonic_health::server::health_reporter();
        let grpc = tokio::net::UnixListener::bind(dir.join("grpc.sock")).unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(grpc)),
        );
        let raw = tokio::net::UnixListener::bind(dir.join("raw.sock")).unwrap();
        loop {
            let (mut s, _) = raw.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1024];
                loop {
                    let mut len = [0u8; 4];
                    if s.read_exact(&mut len).await.is_err() {
                        return;
                    }
                    let n = u32::from_le_bytes(len) as usize;
                    s.read_exact(&mut buf[..n]).await.unwrap();
                    let mut out = Vec::with_capacity(4 + n);
                    out.extend_from_slice(&len);
                    out.extend_from_slice(&buf[..n]);
                    s.write_all(&out).await.unwrap();
                }
            });
        }
    });
}

fn pct(v: &mut [u32], p: f64) -> u32 {
    v.sort_unstable();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn client(args: &[String]) {
    let dir = PathBuf::from(arg(args, "--dir").unwrap());
    let mode = arg(args, "--mode").unwrap();
    let n: usize = arg(args, "--n").unwrap().parse().unwrap();
    let mut lat = Vec::with_capacity(n);
    let us = |t: Instant| t.elapsed().as_micros() as u32;
    match mode.as_str() {
        "raw" => {
            let mut s = std::os::unix::net::UnixStream::connect(dir.join("raw.sock")).unwrap();
            let body = [7u8; 24];
            let mut frame = (body.len() as u32).to_le_bytes().to_vec();
            frame.extend_from_slice(&body);
            let mut back = vec![0u8; frame.len()];
            for i in 0..n + 1000 {
                let t = Instant::now();
                s.write_all(&frame).unwrap();
                s.read_exact(&mut back).unwrap();
                if i >= 1000 {
                    lat.push(us(t));
                }
            }
        }
        _ => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                // `--grpc-socket`: a daemon's socket instead (graphpoold serves health too).
                let path = arg(args, "--grpc-socket").map(PathBuf::from).unwrap_or(dir.join("grpc.sock"));
                let req = || HealthCheckRequest { service: String::new() };
                if mode == "grpc" {
                    let p = path.clone();
                    let ch = tonic::transport::Endpoint::from_static("http://x.invalid")
                        .connect_with_connector(tower::service_fn(move |_| {
                            let p = p.clone();
                            async move {
                                Ok::<_, std::io::Error>(TokioIo::new(
                                    tokio::net::UnixStream::connect(p).await?,
                                ))
                            }
                        }))
                        .await
                        .unwrap();
                    let mut c = HealthClient::new(ch);
                    // `--stream`: keep a server-streaming call open on the same connection
                    // first, as a rank's Attach stream is.
                    let _watch = if args.iter().any(|a| a == "--stream") {
                        Some(c.watch(req()).await.unwrap().into_inner())
                    } else {
                        None
                    };
                    for i in 0..n + 1000 {
                        let t = Instant::now();
                        c.check(req()).await.unwrap();
                        if i >= 1000 {
                            lat.push(us(t));
                        }
                    }
                } else {
                    let io = TokioIo::new(tokio::net::UnixStream::connect(&path).await.unwrap());
                    let (send, conn) = hyper::client::conn::http2::handshake::<_, _, tonic::body::Body>(
                        TokioExecutor::new(),
                        io,
                    )
                    .await
                    .unwrap();
                    tokio::spawn(conn);
                    let svc = tower::service_fn(move |r| {
                        let mut s = send.clone();
                        async move { s.send_request(r).await }
                    });
                    let mut c = HealthClient::with_origin(svc, "http://x.invalid".parse().unwrap());
                    for i in 0..n + 1000 {
                        let t = Instant::now();
                        c.check(req()).await.unwrap();
                        if i >= 1000 {
                            lat.push(us(t));
                        }
                    }
                }
            });
        }
    }
    let p50 = pct(&mut lat, 0.5);
    let p99 = pct(&mut lat, 0.99);
    println!("{p50} {p99}");
}

fn driver(args: &[String]) {
    let n = arg(args, "--n").unwrap_or_else(|| "20000".into());
    let flavours = arg(args, "--flavours").unwrap_or_else(|| "multi,multi1,current".into());
    let exe = std::env::current_exe().unwrap();
    println!("{:<8} {:<12} {:>7} {:>7}", "server", "client", "p50 µs", "p99 µs");
    for flavour in flavours.split(',') {
        let dir = tempfile::Builder::new().prefix("gptr").tempdir_in("/tmp").unwrap();
        let mut srv = Command::new(&exe)
            .args(["server", "--flavour", flavour, "--dir"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        wait(dir.path());
        for mode in ["grpc", "grpc+stream", "grpc-direct", "raw"] {
            let out = Command::new(&exe)
                .args(["client", "--mode", mode.trim_end_matches("+stream"), "--n", &n])
                .args(mode.ends_with("+stream").then_some("--stream"))
                .arg("--dir")
                .arg(dir.path())
                .output()
                .unwrap();
            let s = String::from_utf8_lossy(&out.stdout);
            let mut it = s.split_whitespace();
            let (p50, p99) = (it.next().unwrap_or("?"), it.next().unwrap_or("?"));
            println!("{flavour:<8} {mode:<12} {p50:>7} {p99:>7}");
        }
        let _ = srv.kill();
        let _ = srv.wait();
    }
}

fn wait(dir: &Path) {
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(dir.join("raw.sock")).is_err() {
        assert!(t.elapsed() < Duration::from_secs(10), "server did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
}
