//! A real `redis-server` for the shared-state tests, on a free port, killed
//! on drop. `scripts/test.sh` installs the Debian package.
#![allow(dead_code)]

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` child, killed on drop.
pub struct Server {
    pub port: u16,
    pub password: Option<&'static str>,
    pub child: Option<Child>,
}

pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

impl Server {
    pub fn start() -> Server {
        Server::start_on(free_port(), None)
    }

    pub fn start_on(port: u16, password: Option<&'static str>) -> Server {
        let mut s = Server {
            port,
            password,
            child: None,
        };
        s.spawn();
        s
    }

    pub fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(pw) = self.password {
            cmd.args(["--requirepass", pw]);
        }
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => panic!(
                "cannot start `redis-server` ({e}): install it (Debian: `apt-get install -y redis-server`)"
            ),
        };
        self.child = Some(child);
        // Bounded wait for the port to accept.
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on {} within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn url(&self) -> String {
        match self.password {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}/0", self.port),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}
