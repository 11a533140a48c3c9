/* Loaded with LD_PRELOAD into a local Ray's processes (see local_ray.py beside this file): a bind() to the wildcard
 * address (0.0.0.0 or ::) binds to a loopback address instead, so every server Ray starts (GCS, raylet,
 * workers, agents) listens on loopback only. Ray 2.57 has no setting for this: its gRPC servers bind the
 * wildcard address whatever the node IP is.
 *
 * MAZE_LOOPBACK_IP        IPv4 loopback address to bind instead (default 127.0.0.1); Ray's node IP.
 * MAZE_LOOPBACK_KEEP_PORT a port left alone (a server that is meant to be public, e.g. the keyed HTTP server).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int kept(unsigned short port) {
    const char *keep = getenv("MAZE_LOOPBACK_KEEP_PORT");
    return keep && *keep && atoi(keep) == (int)port;
}

static struct in_addr loopback_ip(void) {
    struct in_addr ip;
    const char *wanted = getenv("MAZE_LOOPBACK_IP");
    if (!wanted || inet_pton(AF_INET, wanted, &ip) != 1) ip.s_addr = htonl(INADDR_LOOPBACK);
    return ip;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in v4;
        memcpy(&v4, addr, sizeof v4);
        if (v4.sin_addr.s_addr == htonl(INADDR_ANY) && !kept(ntohs(v4.sin_port))) {
            v4.sin_addr = loopback_ip();
            return real_bind(fd, (const struct sockaddr *)&v4, sizeof v4);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 v6;
        memcpy(&v6, addr, sizeof v6);
        if (!memcmp(&v6.sin6_addr, &in6addr_any, sizeof v6.sin6_addr) && !kept(ntohs(v6.sin6_port))) {
            /* A dual-stack socket: the IPv4-mapped loopback address keeps IPv4 clients working. */
            struct in_addr ip = loopback_ip();
            memset(&v6.sin6_addr, 0, sizeof v6.sin6_addr);
            v6.sin6_addr.s6_addr[10] = 0xff;
            v6.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&v6.sin6_addr.s6_addr[12], &ip, 4);
            int rc = real_bind(fd, (const struct sockaddr *)&v6, sizeof v6);
            if (rc == 0 || errno != EINVAL) return rc;
            v6.sin6_addr = in6addr_loopback; /* an IPv6-only socket */
            return real_bind(fd, (const struct sockaddr *)&v6, sizeof v6);
        }
    }
    return real_bind(fd, addr, len);
}
