//! [`Stream`]: a long-lived TCP connection to the lab server, whose
//! exchanges show whether a flow survives a change.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

use xtask::netns::in_netns;

use super::T;

/// A long-lived connection (the lab server's `stream`): every line sent is
/// answered with `<pod> <line>`.
pub struct Stream {
    /// The pod that answered the greeting.
    pub pod: String,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// Exchanges that worked.
    pub exchanges: usize,
    /// When and how it broke (set by a test that keeps going without it).
    pub broken: Option<(Instant, String)>,
}

impl Stream {
    /// Starts the stream on a connected socket (reads and writes time out
    /// after [`T`]).
    pub fn from_tcp(s: TcpStream) -> io::Result<Stream> {
        s.set_read_timeout(Some(T))?;
        s.set_write_timeout(Some(T))?;
        let mut writer = s.try_clone()?;
        writer.write_all(b"stream\n")?;
        let mut reader = BufReader::new(s);
        let mut greeting = String::new();
        if reader.read_line(&mut greeting)? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "no greeting"));
        }
        let pod = greeting
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        Ok(Stream {
            pod,
            reader,
            writer,
            exchanges: 0,
            broken: None,
        })
    }

    /// Connects to `vip` (within [`T`]) from the current namespace.
    pub fn open_here(vip: impl Into<SocketAddr>) -> io::Result<Stream> {
        Stream::from_tcp(TcpStream::connect_timeout(&vip.into(), T)?)
    }

    /// Connects to `vip` from namespace `ns`; panics if that fails.
    pub fn open(ns: &str, vip: impl Into<SocketAddr>) -> Stream {
        let vip = vip.into();
        in_netns(ns, move || Stream::open_here(vip))
            .and_then(|r| r)
            .unwrap_or_else(|e| panic!("stream to {vip}: {e}"))
    }

    /// One exchange (`ping <tag>`); the answer must come from the stream's
    /// pod. EOF is an error (`UnexpectedEof`).
    pub fn ping(&mut self, tag: impl std::fmt::Display) -> io::Result<()> {
        self.writer.write_all(format!("ping {tag}\n").as_bytes())?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "EOF"));
        }
        let expected = format!("{} ping {tag}", self.pod);
        if line.trim_end() != expected {
            return Err(io::Error::other(format!(
                "got {line:?}, expected {expected:?}"
            )));
        }
        self.exchanges += 1;
        Ok(())
    }

    /// `n` exchanges (`<what>-<i>`) that must all work.
    pub fn pings(&mut self, n: usize, what: &str) {
        for i in 0..n {
            self.ping(format!("{what}-{i}"))
                .unwrap_or_else(|e| panic!("{what}: stream to {} exchange {i}: {e}", self.pod));
        }
    }
}
