// Loaded into every Node process in a sandbox with network="allow" (NODE_OPTIONS=--require).
// Node's fetch (undici) ignores HTTP_PROXY before Node 22.21/24; this swaps its global
// dispatcher for one whose connections go through the sandbox's egress proxy (a CONNECT
// tunnel, then TLS inside it for https), so fetch works like curl does.  It enforces
// nothing: the proxy outside the sandbox decides every destination.
'use strict';
const net = require('net');
const tls = require('tls');

const proxy = new URL(process.env.HTTPS_PROXY || process.env.HTTP_PROXY || 'http://127.0.0.1:3128');
const noProxy = (process.env.NO_PROXY || '').split(',').map((s) => s.trim().toLowerCase()).filter(Boolean);
const symbol = Symbol.for('undici.globalDispatcher.1');

function finish(opts, socket, callback) {
  if (opts.protocol !== 'https:') return callback(null, socket);
  const host = opts.hostname.replace(/^\[|\]$/g, '');
  const secure = tls.connect({ socket, servername: net.isIP(host) ? undefined : (opts.servername || host),
    ALPNProtocols: ['http/1.1'] });
  secure.once('secureConnect', () => { secure.removeListener('error', callback); callback(null, secure); });
  secure.once('error', callback);
}

function connect(opts, callback) {
  const host = opts.hostname.replace(/^\[|\]$/g, '');
  const port = Number(opts.port) || (opts.protocol === 'https:' ? 443 : 80);
  if (noProxy.includes(host.toLowerCase())) {
    const direct = net.connect(port, host, () => { direct.removeListener('error', callback); finish(opts, direct, callback); });
    direct.once('error', callback);
    return;
  }
  const socket = net.connect(Number(proxy.port) || 3128, proxy.hostname);
  const target = net.isIPv6(host) ? `[${host}]:${port}` : `${host}:${port}`;
  let head = Buffer.alloc(0);
  const onData = (chunk) => {
    head = Buffer.concat([head, chunk]);
    const end = head.indexOf('\r\n\r\n');
    if (end < 0) return;
    socket.removeListener('data', onData);
    socket.removeListener('error', callback);
    socket.pause();
    const status = head.subarray(0, head.indexOf('\r\n')).toString('latin1');
    if (!/^HTTP\/1\.[01] 200/.test(status)) {
      socket.destroy();
      const error = new Error(`corral egress proxy: ${target}: ${status}`);
      error.code = 'ECONNREFUSED';
      return callback(error);
    }
    finish(opts, socket, callback);
  };
  socket.once('error', callback);
  socket.on('data', onData);
  socket.once('connect', () => socket.write(`CONNECT ${target} HTTP/1.1\r\nHost: ${target}\r\n\r\n`));
}

try {
  // the first fetch call loads Node's bundled undici, which installs its default Agent
  // synchronously; a data: URL needs no network
  globalThis.fetch('data:,').catch(() => {});
  const current = globalThis[symbol];
  if (current && typeof current.constructor === 'function') {
    globalThis[symbol] = new current.constructor({ connect });
  }
} catch (_) {
  // an unusual Node: leave fetch as it is (it then fails closed: no route out)
}
